// The GPU run's memory plan (src/train/cuda/memory_plan.h), on the CPU (no GPU needed): what the
// allocators' own sizes predict for every preset against the peaks the benchmarks measured on the GPU
// (bench/results/pipeline.md, drafter-step.md), and the refusal's advice.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <cstdio>

#include "bench/cuda/bench_util.h"
#include "bench/presets.h"
#include "models/cuda/drafter_gpu.h"
#include "models/cuda/target_gpu.h"
#include "train/cuda/memory_plan.h"

using namespace dflash;

namespace {
/// The blocks `dflash bench` trains on for a preset: 512 anchors, or as many as its sample has.
int64_t bench_blocks(const DrafterBenchPreset& d) { return bench_sequence(d.cfg, d.S, 512, nullptr).num_blocks; }

/// `dflash bench pipeline --preset NAME` (colocated, one sample of the preset's S): the plan of that run.
MemoryPlan pipeline_plan(const std::string& name) {
  const PipelineBenchPreset p = pipeline_bench_preset(name);
  return plan_memory(p.drafter.cfg, p.target, p.drafter.S, bench_blocks(p.drafter), false, p.drafter.S, 1, true);
}

void expect_within(double planned, double measured_gb, double tol, const std::string& what) {
  std::printf("[memory plan] %-36s planned %7.2f GB, measured %7.2f GB (%+.1f %%)\n", what.c_str(), planned / 1e9,
              measured_gb, 100 * (planned / 1e9 / measured_gb - 1));
  EXPECT_GT(planned, (1 - tol) * measured_gb * 1e9) << what;
  EXPECT_LT(planned, (1 + tol) * measured_gb * 1e9) << what;
}
}  // namespace

// The peaks `dflash bench pipeline` and `dflash bench drafter-step` measured on one GPU (H100 and
// H200 give the same): the constructors' allocations plus the stream-ordered pool's high-water mark
// (bench/results/2026-12-07_memory_plan_vs_measured_peaks.md; the 35B-A3B pipeline's on an H200).
TEST(MemoryPlan, EveryPresetWithinTenPercentOfItsMeasuredPeak) {
  const struct {
    const char* preset;
    double peak_gb;
  } measured[] = {{"qwen3-8b", 45.506}, {"qwen3.6-27b", 99.803}, {"qwen3.6-35b-a3b", 80.900}, {"tiny", 0.3523}};
  for (const auto& m : measured) {
    const MemoryPlan p = pipeline_plan(m.preset);
    expect_within(p.on_gpu(true, true), m.peak_gb, 0.10, std::string("pipeline ") + m.preset);
  }
  // `dflash bench drafter-step` (the drafter alone: its state and one step).
  for (const auto& [name, peak_gb] :
       {std::pair{"qwen3-8b", 29.087}, std::pair{"qwen3.6-27b", 45.915}, std::pair{"tiny", 0.3041}}) {
    const DrafterBenchPreset d = drafter_bench_preset(name, "test");
    const int64_t taps = 2 * d.S * int64_t(d.cfg.target_layer_ids.size()) * d.cfg.hidden_size;  // the bench's
    const double planned = double(DrafterGpu::state_bytes(d.cfg, d.V) + taps) +
                           pool_reserved(double(DrafterGpu::step_bytes(d.cfg, d.V, d.S, bench_blocks(d), false)));
    expect_within(planned, peak_gb, 0.10, std::string("drafter-step ") + name);
  }
}

// The colocated 27B pair of `dflash bench pipeline --preset qwen3.6-27b`: ~100 GB with a bf16 target, so
// no 80 GB GPU holds it; with --target-dtype fp8 (E4M3 projections, fp32 scales) the plan is under the
// 76 GB an H100 leaves usable.
TEST(MemoryPlan, Fp8TargetPutsThe27bPairOnAn80GbGpu) {
  const PipelineBenchPreset p = pipeline_bench_preset("qwen3.6-27b");
  auto plan = [&](TargetDtype d) {
    return plan_memory(p.drafter.cfg, p.target, p.drafter.S, bench_blocks(p.drafter), false, p.drafter.S, 1, true, d);
  };
  const MemoryPlan bf = plan(TargetDtype::kBf16), f8 = plan(TargetDtype::kFp8);
  std::printf("[memory plan] qwen3.6-27b pipeline: bf16 target %.2f GB (weights %.2f), fp8 target %.2f GB (weights %.2f)\n",
              bf.on_gpu(true, true) / 1e9, bf.target_weights / 1e9, f8.on_gpu(true, true) / 1e9, f8.target_weights / 1e9);
  EXPECT_GT(bf.on_gpu(true, true), 80e9);
  EXPECT_LT(f8.on_gpu(true, true), 76e9);
  // Exactly: every projection [N, K] goes from 2 N K bytes to N K + 4 N (an fp32 scale per output
  // channel); embeddings, the LM head, norms and the GatedDeltaNet vectors stay.
  const ModelSpec& t = p.target;
  const int64_t D = t.hidden_size, Dh = t.head_dim, H = t.num_attention_heads, Hkv = t.num_key_value_heads;
  const int64_t Hv = t.linear_num_value_heads, HvDv = Hv * t.linear_value_head_dim;
  const int64_t Nin = 2 * t.linear_num_key_heads * t.linear_key_head_dim + 2 * HvDv + 2 * Hv;
  double elems = 0, rows = 0;
  auto proj = [&](int64_t N, int64_t K) { elems += double(N * K), rows += double(N); };
  for (int64_t i = 0; i < t.num_hidden_layers; ++i) {
    if (t.layer_types[size_t(i)] == LayerKind::GatedDeltaNet) {
      proj(Nin, D), proj(D, HvDv);
    } else {
      proj(H * Dh, D), proj(Hkv * Dh, D), proj(Hkv * Dh, D), proj(D, H * Dh);
      if (t.attn_output_gate()) proj(H * Dh, D);
    }
    proj(2 * t.intermediate_size, D), proj(D, t.intermediate_size);
  }
  EXPECT_EQ(f8.target_weights, bf.target_weights - elems + 4 * rows);
}

TEST(MemoryPlan, PartsAddUpByPlacement) {
  const MemoryPlan m = pipeline_plan("qwen3.6-27b");
  // The hybrid's weights as stored (48 GatedDeltaNet + 16 attention layers, bf16): ~54 GB.
  EXPECT_GT(m.target_weights, 50e9);
  EXPECT_LT(m.target_weights, 58e9);
  EXPECT_GT(m.drafter_state, 30e9);  // 1.73 B parameters x 18 bytes, embed and lm_head
  // Taking turns on one GPU: the larger of the forward's and the step's temporaries.
  EXPECT_DOUBLE_EQ(m.on_gpu(true, true), m.target_weights + m.drafter_state +
                                             pool_reserved(m.taps + std::max(m.target_forward, m.drafter_step)));
  EXPECT_DOUBLE_EQ(m.on_gpu(true, false), m.target_weights + pool_reserved(m.target_forward + m.taps));
  EXPECT_DOUBLE_EQ(m.on_gpu(false, true), m.drafter_state + pool_reserved(m.drafter_step + m.sample_taps));
  // The pool grows in 32 MiB granules.
  EXPECT_DOUBLE_EQ(pool_reserved(1), 33554432.0);
  EXPECT_DOUBLE_EQ(pool_reserved(33554432), 33554432.0);
  EXPECT_DOUBLE_EQ(pool_reserved(33554433), 2 * 33554432.0);
  // Several GPUs, colocated: replicas on their own threads hold both, and the queued packs.
  const PipelineBenchPreset p = pipeline_bench_preset("qwen3.6-27b");
  const MemoryPlan threads = plan_memory(p.drafter.cfg, p.target, 4096, 512, false, 8192, 2, false);
  EXPECT_GT(threads.on_gpu(true, true), m.on_gpu(true, true) + std::min(m.target_forward, m.drafter_step));
  // Recomputation keeps fewer activations; the MoE target's experts count (the old plan's 15.8 GB).
  EXPECT_LT(plan_memory(p.drafter.cfg, p.target, 4096, 512, true, 4096, 1, true).drafter_step, m.drafter_step);
  EXPECT_GT(pipeline_plan("qwen3.6-35b-a3b").target_weights, 65e9);
}

TEST(MemoryPlan, RefusalNamesTheKnobThatHelps) {
  const MemoryPlan m = pipeline_plan("qwen3.6-27b");
  auto refuse = [](const MemoryPlan& p, bool t, bool d, int gpu, double free_b) {
    return memory_refusal(p, t, d, gpu, free_b, "lower --num-anchors or --max-length");
  };
  const double h100 = 79e9, h200 = 140e9;
  EXPECT_EQ(refuse(m, true, true, 0, h200), "");  // colocated on an H200
  EXPECT_EQ(refuse(m, true, true, 0, 0), "");     // free memory unknown: no refusal
  // Colocated on an 80 GB GPU: the target and the drafter's state alone do not fit; only two GPUs help.
  const std::string both = refuse(m, true, true, 0, h100);
  EXPECT_NE(both.find("on cuda:0, more than the 75.0 GB usable there (95 % of 79.0 GB free)"), std::string::npos)
      << both;
  EXPECT_NE(both.find("--target-gpus 0 --drafter-gpus 1"), std::string::npos) << both;
  EXPECT_EQ(both.find("--num-anchors"), std::string::npos) << both;
  // Disaggregated, each side fits one 80 GB GPU.
  EXPECT_EQ(refuse(m, true, false, 0, h100), "");
  EXPECT_EQ(refuse(m, false, true, 1, h100), "");
  // A drafter GPU short of room for the step: fewer anchors help.
  const double some = (m.drafter_state + 0.5 * m.drafter_step) / 0.95;
  const std::string drafter = refuse(m, false, true, 1, some);
  EXPECT_NE(drafter.find("on cuda:1"), std::string::npos) << drafter;
  EXPECT_NE(drafter.find("lower --num-anchors or --max-length (the activations scale with them)"), std::string::npos)
      << drafter;
  EXPECT_EQ(drafter.find("--target-gpus"), std::string::npos) << drafter;
  // A target GPU too small for the weights.
  EXPECT_NE(refuse(m, true, false, 0, 20e9).find("the target does not fit"), std::string::npos);
  // The 35B-A3B pair on an 80 GB GPU: refused up front (the plan from the shapes alone said 15.8 GB).
  EXPECT_NE(refuse(pipeline_plan("qwen3.6-35b-a3b"), true, true, 0, h100), "");
}

#endif  // DFLASH_HAVE_CUDA
