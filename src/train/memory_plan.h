// Device memory a GPU training run needs, estimated from the shapes before anything is allocated, and
// the refusal `dflash train --device cuda` gives a run that cannot fit (src/train/run.cpp).
#pragma once
#include <cstdint>
#include <string>

#include "models/drafter_config.h"
#include "models/model_spec.h"

namespace dflash {

/// Bytes per part (decimal GB in the log).
struct MemoryPlan {
  double drafter_state = 0;  // fp32 masters, bf16 copy, gradients, AdamW moments; embed + lm_head (bf16)
  double target = 0;         // bf16 weights, one packed forward's activations, two queued taps
  double activations = 0;    // the drafter step's saved activations and backward temporaries, the taps
  double cross_entropy = 0;  // the chunked cross entropy's logits (1 GB chunk) and its gradient
  double total() const { return drafter_state + target + activations + cross_entropy; }
  /// What one GPU holds: the target's part, the drafter's, or both (colocated).
  double on_gpu(bool target_here, bool drafter_here) const;
};

/// The plan for sequences of up to S tokens, `anchors` blocks of dc.block_size, the target packed
/// up to pack_tokens tokens per forward; recompute: only each layer's input is kept.
MemoryPlan plan_memory(const DrafterConfig& dc, const ModelSpec& ts, int64_t S, int64_t anchors, bool recompute,
                       int64_t pack_tokens);

/// "" when need_b fits within 95 % of free_b on cuda:gpu, else the refusal: the bytes needed and free,
/// and the knob that helps. target_here / drafter_here: what the GPU holds (both: colocated); when
/// the target and the drafter state alone exceed it, only separate GPUs (--target-gpus /
/// --drafter-gpus) or a larger GPU help, and the refusal says so. shrink: the caller's own flags
/// that cut the drafter's activations (e.g. "lower --num-anchors or --max-length").
std::string memory_refusal(const MemoryPlan& p, bool target_here, bool drafter_here, int gpu, double free_b,
                           const std::string& shrink);

}  // namespace dflash
