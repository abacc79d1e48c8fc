// The GPU training backend: the target's taps by TargetGpu and the drafter step + optimizer by
// DrafterGpu: on one GPU, or target and drafter replicas over several (colocated or disaggregated).
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "gpu/runtime.h"
#include "train/gpu.h"

namespace dflash {

class TargetGpu;
class DrafterGpu;

/// Makes one replica's target / drafter on the current device, on stream `s` (every replica of a
/// backend must start from the same drafter weights).
struct GpuReplicaFactory {
  std::function<std::unique_ptr<TargetGpu>(cudaStream_t s)> target;
  std::function<std::unique_ptr<DrafterGpu>(cudaStream_t s)> drafter;
};

/// make_gpu_backend (train/gpu.h) over replicas made by `f` (benchmarks: random weights on the device).
std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const GpuReplicaFactory& f,
                                                 const std::vector<int>& target_devices,
                                                 const std::vector<int>& drafter_devices, const GpuTrainOptions& opt = {});

}  // namespace dflash
