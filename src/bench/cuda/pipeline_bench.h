// `dflash bench pipeline`: the whole training pipeline of one sample on one GPU, colocated, random
// weights and the real shapes: the frozen target's forward to its deepest tap (TargetGpu::forward_taps)
// and one drafter training step on those taps (forward, backward, clip + AdamW). Records samples/s,
// tokens/s and peak memory with a stage breakdown (bench/results/pipeline.jsonl).
#pragma once
#include <cstdint>
#include <string>

namespace dflash {

struct PipelineBenchOptions {
  std::string preset;                  // "qwen3-8b" | "tiny" (pipeline_bench_preset; "qwen3.6-27b" is refused)
  int64_t seq = 0;                     // context length S (0: the preset's)
  int64_t anchors = 512;               // anchors per sequence (blocks of the preset's block size)
  int steps = 10, warmup = 3;          // timed samples (median recorded) after warm-up samples
  std::string results = "bench/results";
  bool record = true;                  // append to results/pipeline.jsonl
};

/// Runs the benchmark on GPU 0; prints one JSON line per metric (samples_per_s, tokens_per_s,
/// peak_gb). Returns the exit code. Throws std::invalid_argument for an unknown preset or one whose
/// target the GPU backend cannot run (the reason in the message), std::runtime_error without a
/// usable device or on CUDA errors.
int run_pipeline_bench(const PipelineBenchOptions& o);

}  // namespace dflash
