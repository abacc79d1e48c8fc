// GPU benchmarks of the target side: `dflash bench gdn` (the GatedDeltaNet recurrence kernels alone,
// Qwen3.6-27B head shapes) and `dflash bench target-forward --device cuda` (a whole target forward
// with random weights, with the LM head and on the training path to the deepest tap).
// Records go to bench/results/{gdn,target-forward}.jsonl.
#pragma once
#include <cstdint>
#include <string>

#include "models/target_dtype.h"

namespace dflash {

struct GdnBenchOptions {
  int steps = 20, warmup = 5;  // timed runs (median recorded) after warm-up runs
  std::string results = "bench/results";
  bool record = true;
};

/// Times, on GPU 0, gated_delta_rule_chunked (and, apart, gdn_prepare and causal_conv1d_silu) for
/// Hk 16, Hv 48, dk = dv 128 at T 4096, T 16384 and 8 packed sequences of 512; records ms per shape
/// (bench gdn, presets t4096 / t16384 / packed8x512, metric ms). Returns the exit code.
int run_gdn_bench(const GdnBenchOptions& o);

struct TargetForwardGpuOptions {
  std::string preset;           // a pipeline preset: "qwen3.6-27b" | "qwen3-8b" | "tiny"
  int64_t tokens = 4096;        // T (one sequence)
  int64_t layers = 0;           // > 0: only the first `layers` layers of the preset (same layer pattern)
  int repeat = 5, warmup = 2;
  std::string results = "bench/results";
  bool record = true;
  TargetDtype dtype = TargetDtype::kBf16;  // the target's projections (the preset name gets "-fp8")
  int64_t accuracy_tokens = 256;  // under kFp8: tokens of the comparison with the bf16 target
};

/// Times the preset's target (random weights) on GPU 0: forward with the LM head (argmax on the GPU;
/// the [T, V] logits are computed but never copied), and forward_taps to the drafter preset's deepest
/// tap (the training path). Records tokens_per_s and tokens_per_s_taps with the share of a cuBLAS
/// GEMM peak measured in the same run. Under kFp8, also the relative L2 of the taps and logits against
/// the bf16 target with the same weights (fp8_vs_bf16_rel_l2, on accuracy_tokens tokens). Throws std::invalid_argument for an unknown preset.
int run_target_forward_gpu_bench(const TargetForwardGpuOptions& o);

}  // namespace dflash
