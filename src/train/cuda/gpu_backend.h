// The GPU training backend: the target's taps by TargetGpu and the drafter step + optimizer by
// DrafterGpu, both on one GPU and one stream (colocated placement).
#pragma once
#include <memory>

#include "train/backend.h"

namespace dflash {

class TargetModel;

/// Builds the target (bf16) and the drafter (fp32 masters from `weights`, the target's embed_tokens
/// and lm_head frozen) on GPU `device`. `target` is only read during construction. Throws
/// std::invalid_argument when the target cannot run on the GPU (the reason is in the message) or
/// the drafter's head_dim is not 64 / 128; std::runtime_error on CUDA errors.
/// `recompute`: activation recomputation in the drafter step (DrafterGpuStepOptions::recompute).
std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                                 const TargetModel& target, int device, bool recompute = false);

}  // namespace dflash
