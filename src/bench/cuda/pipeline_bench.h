// `dflash bench pipeline`: the whole training pipeline of one sample on one GPU, colocated, random
// weights and the real shapes: the frozen target's forward to its deepest tap (TargetGpu::forward_taps)
// and one drafter training step on those taps (forward, backward, clip + AdamW). Records samples/s,
// tokens/s and peak memory with a stage breakdown (bench/results/pipeline.jsonl).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/target_dtype.h"

namespace dflash {

struct PipelineBenchOptions {
  std::string preset;                  // "qwen3-8b" | "tiny" (pipeline_bench_preset; "qwen3.6-27b" is refused)
  int64_t seq = 0;                     // context length S (0: the preset's)
  int64_t anchors = 512;               // anchors per sequence (blocks of the preset's block size)
  int steps = 10, warmup = 3;          // timed samples (median recorded) after warm-up samples
  std::string results = "bench/results";
  bool record = true;                  // append to results/pipeline.jsonl
  // The training path over GPUs (when either list is set): the trainer and the GPU backend of
  // `dflash train` (make_gpu_backend) on these GPUs, `per_replica` samples per drafter replica per
  // optimizer step. Empty target_gpus: the drafter GPUs (colocated).
  std::vector<int> target_gpus, drafter_gpus;
  int per_replica = 2;
  TargetDtype target_dtype = TargetDtype::kBf16;  // the target's projections (the preset name gets "-fp8")
};

/// Runs the benchmark on GPU 0 (or, with GPU lists, the training path over those GPUs: samples/s
/// = samples per optimizer step / median step wall time); prints one JSON line per metric
/// (samples_per_s, tokens_per_s, peak_gb; the training path reports GPU 0's peak). Returns the exit code. Throws std::invalid_argument for an unknown preset or one whose
/// target the GPU backend cannot run (the reason in the message), std::runtime_error without a
/// usable device or on CUDA errors.
int run_pipeline_bench(const PipelineBenchOptions& o);

}  // namespace dflash
