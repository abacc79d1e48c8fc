// train/gpu.h in a CPU-only build: refused (run.cpp says so before either is reached).
#include <stdexcept>

#include "gpu/backend.h"
#include "train/gpu.h"

namespace dflash {

std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig&, const DrafterWeights<float>&, const TargetModel&,
                                                 const std::vector<int>&, const std::vector<int>&,
                                                 const GpuTrainOptions&) {
  throw std::runtime_error(no_cuda_backend("--device cuda"));
}

void check_gpu_memory(const TrainConfig&, const DrafterConfig&, const ModelSpec&, int64_t, int64_t, int) {
  throw std::runtime_error(no_cuda_backend("--device cuda"));
}

}  // namespace dflash
