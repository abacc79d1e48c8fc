// The CPU-only build's answers to gpu/backend.h and gpu/device_info.h: no backend, no GPUs.
#include <stdexcept>

#include "gpu/backend.h"
#include "gpu/device_info.h"

namespace dflash {

bool cuda_backend_built() { return false; }

namespace cuda {

std::vector<DeviceInfo> devices() { return {}; }

void require_device(const std::string& what, int) { throw std::runtime_error(no_cuda_backend(what)); }

int64_t memory_in_use() { return -1; }

}  // namespace cuda
}  // namespace dflash
