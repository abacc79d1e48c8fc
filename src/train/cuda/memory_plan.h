// Device memory a GPU training run needs, from the sizes TargetGpu and DrafterGpu allocate with
// (TargetGpu::weight_bytes / forward_taps_bytes, DrafterGpu::state_bytes / step_bytes) before anything
// is allocated, and the refusal `dflash train --device cuda` and `dflash bench pipeline` give a run
// that cannot fit.
#pragma once
#include <cstdint>
#include <string>

#include "models/drafter_config.h"
#include "models/model_spec.h"
#include "models/target_dtype.h"

namespace dflash {

/// Bytes per part (decimal GB in the log).
struct MemoryPlan {
  double target_weights = 0;  // the target's weights as TargetGpu stores them (bf16 or fp8), its GEMM workspace
  double target_forward = 0;  // the most one packed forward_taps holds beyond them
  double drafter_state = 0;   // fp32 masters, gradients, AdamW moments, bf16 copy; embed + lm_head (bf16)
  double drafter_step = 0;    // the most one training step holds: saved activations, cross entropy, backward
  double taps = 0;            // one packed forward's taps (bf16, K x d per token)
  double sample_taps = 0;     // one sample's taps (a drafter GPU's peer-to-peer copy, disaggregated)
  int64_t taps_in_flight = 1; // packs alive at once on a target GPU (a queue of 2 behind the one being made)
  /// Target and drafter on one GPU take turns (a single GPU: forward, then the steps); with several
  /// GPUs each replica runs on its own thread, so a colocated GPU holds both at once.
  bool take_turns = true;
  /// What one GPU holds: the target's part, the drafter's, or both (colocated): the constructors'
  /// allocations and the taps, then what the pool reserves for the forwards' and steps' buffers.
  double on_gpu(bool target_here, bool drafter_here) const;
};

/// The device memory the stream-ordered pool reserves to serve `bytes` of live allocations: it grows
/// in 32 MiB granules (every high-water mark the benchmarks measured is a multiple of 32 MiB).
double pool_reserved(double bytes);

/// The plan for samples of up to S tokens, `anchors` blocks of dc.block_size, the target packed up to
/// pack_tokens tokens per forward in at most pack_sequences sequences; recompute: only each draft
/// layer's input is kept; take_turns: MemoryPlan::take_turns; target_dtype: how the target is stored.
MemoryPlan plan_memory(const DrafterConfig& dc, const ModelSpec& ts, int64_t S, int64_t anchors, bool recompute,
                       int64_t pack_tokens, int64_t pack_sequences, bool take_turns,
                       TargetDtype target_dtype = TargetDtype::kBf16);

/// "" when the GPU's part fits within 95 % of free_b on cuda:gpu, else the refusal: the bytes needed
/// and free, and the knob that helps. target_here / drafter_here: what the GPU holds (both:
/// colocated); when the target's weights and the drafter's state alone exceed it, only separate GPUs
/// (--target-gpus / --drafter-gpus) or a larger GPU help, and the refusal says so. shrink: the
/// caller's own flags that cut the drafter's activations (e.g. "lower --num-anchors or --max-length").
std::string memory_refusal(const MemoryPlan& p, bool target_here, bool drafter_here, int gpu, double free_b,
                           const std::string& shrink);

}  // namespace dflash
