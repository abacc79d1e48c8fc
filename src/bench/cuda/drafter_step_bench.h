// `dflash bench drafter-step`: one GPU, random weights, the published drafter shapes; times the
// whole training step (forward, backward, clip + AdamW) and records step_ms and peak_gb with a
// cuBLAS bf16 GEMM peak measured in the same run (bench/results/drafter-step.jsonl).
#pragma once
#include <cstdint>
#include <string>

namespace dflash {

struct DrafterStepBenchOptions {
  std::string preset;                  // "qwen3-8b" | "qwen3.6-27b" | "tiny"
  int64_t seq = 0;                     // context length S (0: the preset's)
  int64_t anchors = 512;               // anchors per sequence (blocks of the preset's block size)
  int steps = 10, warmup = 3;          // timed steps (median recorded) after warm-up steps
  std::string results = "bench/results";
  bool record = true;                  // append to results/drafter-step.jsonl
  bool recompute = false;              // activation recomputation (DrafterGpuStepOptions::recompute)
  bool dpace = false;                  // D-PACE's slot weights (one more forward-only cross entropy)
};

/// Runs the benchmark on GPU 0; prints one JSON line per metric. Returns the exit code.
/// Throws std::invalid_argument for an unknown preset.
int run_drafter_step_bench(const DrafterStepBenchOptions& o);

}  // namespace dflash
