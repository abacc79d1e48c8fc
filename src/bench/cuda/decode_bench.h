// `dflash bench decode`: batch decoding on one GPU with the engine `dflash eval`, `generate` and
// `prepare --regenerate` decode with (TargetGpu's KV cache and GatedDeltaNet states), random weights
// of a preset's real shapes: tokens/s and memory per batch size, beside the memory-bandwidth bound
// measured in the same run (bench/results/decode.jsonl).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/target_dtype.h"

namespace dflash {

struct DecodeBenchOptions {
  std::string preset;                     // "qwen3.6-27b" | "qwen3-8b" | "qwen3.6-35b-a3b" | "tiny"
  std::vector<int64_t> batches = {1, 16, 64, 256};
  int64_t prompt_tokens = 128, new_tokens = 512;  // per sequence
  TargetDtype dtype = TargetDtype::kBf16;
  std::string results = "bench/results";
  bool record = true;
};

/// Per batch size B: B random prompts of prompt_tokens prefilled (at most 8192 tokens a forward),
/// then new_tokens greedy steps of one token per sequence (forward_cached with the argmax on the GPU,
/// each step's tokens read back, as plain decoding does); records decode tokens/s = B x new_tokens /
/// the steps' wall time, the memory held after the run (weights, cache, states) plus the pool's
/// high-water mark, and the bandwidth bound: the bytes one step must read (every weight the step
/// touches once: all of a dense model's; a MoE layer's experts in the expected share that B tokens
/// route to; the LM head; each sequence's keys / values at the mean context; the GatedDeltaNet
/// states read and written) over the device-to-device copy bandwidth measured first. Returns the
/// exit code. Throws std::invalid_argument for an unknown preset, std::runtime_error without a GPU.
int run_decode_bench(const DecodeBenchOptions& o);

}  // namespace dflash
