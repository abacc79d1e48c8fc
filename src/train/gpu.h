// The GPU half of `dflash train` as CPU-side code calls it (CUDA-free): src/train/cuda, or in a
// CPU-only build src/train/no_cuda.cpp, which refuses.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "models/drafter.h"
#include "models/model_spec.h"
#include "models/target_dtype.h"
#include "train/backend.h"
#include "train/distributed.h"
#include "train/train_config.h"

namespace dflash {

class TargetModel;

/// Options of the GPU backend.
struct GpuTrainOptions {
  bool recompute = false;               // activation recomputation in the drafter step
  int64_t target_batch_tokens = 8192;   // a target forward packs consecutive samples up to this many tokens
  TargetDtype target_dtype = TargetDtype::kBf16;  // how the target replicas' projections compute
  ProcessGroup pg;                      // several processes: their drafter replicas form one NCCL group
};

/// Builds target replicas (bf16) on `target_devices` and drafter replicas (fp32 masters from
/// `weights`, the target's embed_tokens and lm_head frozen) on `drafter_devices` (CUDA indices,
/// distinct within each list). One GPU in both: everything there, on the caller's thread. Equal
/// lists: colocated, a target + drafter replica per GPU. Disjoint: disaggregated, taps copied peer
/// to peer. With several drafter replicas their gradients are summed by an NCCL all-reduce before each optimizer
/// step. `target` is only read during construction. Throws std::invalid_argument when the target
/// cannot run on the GPU (the reason is in the message), the drafter's head_dim is not 64 / 128 or a
/// list is empty / repeats a GPU; std::runtime_error on CUDA / NCCL errors.
/// Each target replica packs runs of its micro-batches (in order, up to opt.target_batch_tokens
/// tokens) into one varlen forward; micro-batches are dealt to replicas balanced by tokens (longest
/// first to the least loaded).
std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                                 const TargetModel& target, const std::vector<int>& target_devices,
                                                 const std::vector<int>& drafter_devices, const GpuTrainOptions& opt = {});

/// `dflash train --device cuda` before anything is allocated: logs each GPU's memory plan (plan_memory,
/// samples of `shortest` to `longest` tokens) against its free memory, and throws std::runtime_error
/// with memory_refusal's reason for a GPU the run does not fit. world: the processes training together.
void check_gpu_memory(const TrainConfig& c, const DrafterConfig& dc, const ModelSpec& target, int64_t longest,
                      int64_t shortest, int world);

}  // namespace dflash
