// The CPU-only build's GPU half of models/target.h: refused (layer_kernels asks cuda_backend_built first).
#include <stdexcept>

#include "gpu/backend.h"
#include "models/target.h"

namespace dflash {

KernelChoice gpu_layer_kernel(const ModelSpec&, int64_t, TargetDtype) {
  throw std::runtime_error(no_cuda_backend("gpu_layer_kernel"));
}

}  // namespace dflash
