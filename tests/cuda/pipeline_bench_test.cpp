// The pieces of `dflash bench pipeline` on the GPU: TargetGpu with random weights made on the device
// (deterministic per seed, taps equal to its forward's hidden states, hybrids refused) and the tiny
// benchmark end to end (its three records).
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "bench/cuda/pipeline_bench.h"
#include "bench/presets.h"
#include "cuda_test_util.h"
#include "models/cuda/target_gpu.h"
#include "test_util.h"

using namespace dflash;

TEST(CudaBench, RandomTargetIsSeededAndItsTapsMatchItsForward) {
  if (!cuda::has_device()) GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs in scripts/gpu_check.sh)";
  const ModelSpec spec = pipeline_bench_preset("tiny").target;
  const int64_t T = 96, D = spec.hidden_size;
  std::mt19937_64 rng(3);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& t : ids) t = int32_t(rng() % uint64_t(spec.vocab_size));
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    TargetGpu a(spec, 5, s), b(spec, 5, s), c(spec, 6, s);
    cuda::DeviceArray<cuda::bf16> ta(size_t(T * 2 * D)), tb(ta.size()), tc(ta.size());
    a.forward_taps(ids, {0, T}, {1, 3}, ta.data());
    b.forward_taps(ids, {0, T}, {1, 3}, tb.data());
    c.forward_taps(ids, {0, T}, {1, 3}, tc.data());
    const std::vector<float> ha = test::to_host_f32(ta, s), hb = test::to_host_f32(tb, s), hc = test::to_host_f32(tc, s);
    EXPECT_TRUE(test::all_finite(ha));
    EXPECT_EQ(std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(float)), 0) << "same seed, other weights";
    EXPECT_GT(test::rel_l2(ha, hc), 0.1) << "another seed, the same weights";
    // Tap k of layer i is hidden_states[i + 1] rounded to bf16.
    ForwardOptions fo;
    fo.hidden_states = {2, 4};
    const ForwardOutput out = a.forward(ids, {0, T}, fo);
    EXPECT_TRUE(test::all_finite(out.logits.data));
    EXPECT_EQ(out.logits.shape, (std::vector<int64_t>{T, spec.vocab_size}));
    for (int64_t k = 0; k < 2; ++k)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < D; ++i)
          ASSERT_EQ(ha[size_t(t * 2 * D + k * D + i)],
                    bf16_to_f32(f32_to_bf16(out.hidden_states.at(int(2 + 2 * k)).data[size_t(t * D + i)])))
              << "tap " << k << " token " << t << " dim " << i;
  }
  // A target the GPU cannot run (attention head_dim 16) is refused with the reason, as from a checkpoint.
  const ModelSpec hybrid = TargetModel::load((test::fixtures_dir() / "qwen3_5_text").string())->spec();
  try {
    TargetGpu h(hybrid, 1, s);
    ADD_FAILURE() << "a head_dim 16 target was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 16"), std::string::npos) << e.what();
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(CudaBench, PipelineTinyRecordsSamplesTokensAndPeakMemory) {
  if (!cuda::has_device()) GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs in scripts/gpu_check.sh)";
  test::TempDir d;
  PipelineBenchOptions o;
  o.preset = "tiny";
  o.anchors = 16, o.steps = 2, o.warmup = 1;
  o.results = d.path().string();
  ASSERT_EQ(run_pipeline_bench(o), 0);
  std::ifstream f(d / "pipeline.jsonl");
  std::string line;
  std::map<std::string, nlohmann::json> by_metric;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    by_metric[j["metric"].get<std::string>()] = j;
  }
  ASSERT_EQ(by_metric.size(), 3u);
  const double sps = by_metric.at("samples_per_s")["value"].get<double>();
  EXPECT_GT(sps, 0);
  EXPECT_NEAR(by_metric.at("tokens_per_s")["value"].get<double>(), sps * 256, 1e-6 * sps * 256);
  EXPECT_GT(by_metric.at("peak_gb")["value"].get<double>(), 0);
  const nlohmann::json& x = by_metric.at("samples_per_s")["extra"];
  EXPECT_EQ(x["S"], 256);
  EXPECT_EQ(x["target_layers_run"], 6);  // taps [1..5] of 8 layers
  EXPECT_NEAR(x["sample_ms"].get<double>(), 1e3 / sps, 1e-9 * 1e3 / sps);
  EXPECT_TRUE(std::isfinite(x["loss"].get<double>()));
  for (const char* stage : {"target_forward", "drafter_forward", "drafter_cross_entropy", "drafter_backward",
                            "drafter_optimizer"})
    EXPECT_GT(x["stage_ms"][stage].get<double>(), 0) << stage;
}

#endif
