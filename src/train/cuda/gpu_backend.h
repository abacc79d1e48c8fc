// The GPU training backend: the target's taps by TargetGpu and the drafter step + optimizer by
// DrafterGpu, both on one GPU and one stream (colocated placement); on several GPUs, data parallel.
#pragma once
#include <memory>
#include <vector>

#include "train/backend.h"

namespace dflash {

class TargetModel;

/// Builds the target (bf16) and the drafter (fp32 masters from `weights`, the target's embed_tokens
/// and lm_head frozen) on each GPU of `devices` (CUDA indices, distinct). One GPU: everything there.
/// Several: data parallel, a target + drafter replica per GPU, micro-batches dealt round-robin, the
/// gradients summed by an NCCL all-reduce before each optimizer step. `target` is only read during
/// construction. Throws std::invalid_argument when the target cannot run on the GPU (the reason is in
/// the message) or the drafter's head_dim is not 64 / 128; std::runtime_error on CUDA / NCCL errors.
/// `recompute`: activation recomputation in the drafter step (DrafterGpuStepOptions::recompute).
std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                                 const TargetModel& target, const std::vector<int>& devices,
                                                 bool recompute = false);

}  // namespace dflash
