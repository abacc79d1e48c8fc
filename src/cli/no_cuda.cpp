// cli/gpu.h in a CPU-only build.
#include <stdexcept>

#include "cli/gpu.h"
#include "gpu/backend.h"

namespace dflash::cli {

nlohmann::json gpu_weight_bytes(const ModelSpec&) { return nullptr; }

nlohmann::json cuda_description() { return {{"built", false}}; }

ForwardOutput forward_on_gpu(const TargetModel&, const std::vector<int32_t>&, const std::vector<int64_t>&,
                             const ForwardOptions&, TargetDtype) {
  throw std::runtime_error(no_cuda_backend("forward --device cuda"));
}

}  // namespace dflash::cli
