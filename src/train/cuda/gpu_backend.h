// The GPU training backend: the target's taps by TargetGpu and the drafter step + optimizer by
// DrafterGpu: on one GPU, or target and drafter replicas over several (colocated or disaggregated).
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "models/target_dtype.h"
#include "ops/cuda/runtime.h"
#include "train/backend.h"
#include "train/distributed.h"

namespace dflash {

class TargetModel;
class TargetGpu;
class DrafterGpu;

/// Options of the GPU backend.
struct GpuTrainOptions {
  bool recompute = false;               // activation recomputation in the drafter step
  int64_t target_batch_tokens = 8192;   // a target forward packs consecutive samples up to this many tokens
  TargetDtype target_dtype = TargetDtype::kBf16;  // how the target replicas' projections compute
  ProcessGroup pg;                      // several processes: their drafter replicas form one NCCL group
};

/// Makes one replica's target / drafter on the current device, on stream `s` (every replica of a
/// backend must start from the same drafter weights).
struct GpuReplicaFactory {
  std::function<std::unique_ptr<TargetGpu>(cudaStream_t s)> target;
  std::function<std::unique_ptr<DrafterGpu>(cudaStream_t s)> drafter;
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

/// The same over replicas made by `f` (benchmarks: random weights on the device).
std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const GpuReplicaFactory& f,
                                                 const std::vector<int>& target_devices,
                                                 const std::vector<int>& drafter_devices, const GpuTrainOptions& opt = {});

}  // namespace dflash
