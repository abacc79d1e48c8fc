// The GPU benchmarks' presets, checked on the host: the pipeline's target has the real shapes and
// fits its drafter (the drafter-step preset of the same name), Qwen3.6-27B's is the hybrid.
#include <gtest/gtest.h>

#include <algorithm>

#include "bench/presets.h"
#include "models/target.h"

using namespace dflash;

TEST(BenchPresets, PipelineTargetHasTheRealShapesAndFitsItsDrafter) {
  const PipelineBenchPreset p = pipeline_bench_preset("qwen3-8b");
  const ModelSpec& t = p.target;
  EXPECT_EQ(t.arch, Arch::Qwen3);
  EXPECT_EQ(t.num_hidden_layers, 36);
  EXPECT_EQ(t.hidden_size, 4096);
  EXPECT_EQ(t.num_attention_heads, 32);
  EXPECT_EQ(t.num_key_value_heads, 8);
  EXPECT_EQ(t.head_dim, 128);
  EXPECT_EQ(t.intermediate_size, 12288);
  EXPECT_EQ(t.vocab_size, 151936);
  EXPECT_EQ(t.rope.theta, 1e6);
  EXPECT_EQ(t.rms_norm_eps, 1e-6);
  EXPECT_EQ(p.drafter.S, 3072);
  EXPECT_EQ(p.drafter.cfg.target_layer_ids, (std::vector<int64_t>{1, 9, 17, 25, 33}));
  for (const char* name : {"qwen3-8b", "tiny"}) {
    const PipelineBenchPreset q = pipeline_bench_preset(name);
    EXPECT_EQ(gpu_unsupported_reason(q.target), "") << name;
    EXPECT_NO_THROW(q.target.validate(name));
    EXPECT_NO_THROW(q.drafter.cfg.validate(name));
    // The drafter is drafter-step's preset, trained on this target's taps.
    const DrafterBenchPreset d = drafter_bench_preset(name, "test");
    EXPECT_EQ(drafter_config_to_json(q.drafter.cfg), drafter_config_to_json(d.cfg)) << name;
    EXPECT_EQ(q.drafter.V, d.V) << name;
    EXPECT_EQ(q.drafter.S, d.S) << name;
    EXPECT_EQ(q.drafter.cfg.hidden_size, q.target.hidden_size) << name;
    EXPECT_EQ(q.drafter.V, q.target.vocab_size) << name;
    EXPECT_EQ(q.drafter.cfg.num_target_layers, q.target.num_hidden_layers) << name;
    const auto& ids = q.drafter.cfg.target_layer_ids;
    EXPECT_LT(*std::max_element(ids.begin(), ids.end()), q.target.num_hidden_layers) << name;
  }
}

TEST(BenchPresets, PipelineQwen36IsTheHybridTarget) {
  const PipelineBenchPreset p = pipeline_bench_preset("qwen3.6-27b");
  EXPECT_EQ(gpu_unsupported_reason(p.target), "");
  EXPECT_EQ(std::count(p.target.layer_types.begin(), p.target.layer_types.end(), LayerKind::GatedDeltaNet), 48);
  EXPECT_EQ(std::count(p.target.layer_types.begin(), p.target.layer_types.end(), LayerKind::Attention), 16);
  EXPECT_EQ(p.target.linear_num_value_heads, 48);
  EXPECT_EQ(p.drafter.cfg.hidden_size, 5120);
}

TEST(BenchPresets, UnknownNamesAreRefusedWithTheChoices) {
  for (auto f : {+[] { pipeline_bench_preset("qwen3-9b"); }, +[] { drafter_bench_preset("qwen3-9b", "bench drafter-step"); }}) {
    try {
      f();
      FAIL() << "unknown preset accepted";
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("unknown preset 'qwen3-9b' (qwen3-8b, qwen3.6-27b, qwen3.6-35b-a3b, tiny)"), std::string::npos) << m;
    }
  }
}
