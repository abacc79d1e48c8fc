// The CPU-only build's GPU engine: refused (gpu/backend.h).
#include <stdexcept>

#include "gpu/backend.h"
#include "spec/decoder.h"

namespace dflash {

std::unique_ptr<TargetDecoder> make_gpu_decoder(const TargetModel&, std::vector<int64_t>, int, TargetDtype) {
  throw std::runtime_error(no_cuda_backend("the GPU decoder"));
}

std::unique_ptr<BlockDrafter> make_gpu_drafter(const DrafterConfig&, const DrafterWeights<float>&, const Tensor&,
                                               const Tensor&, int) {
  throw std::runtime_error(no_cuda_backend("the GPU drafter"));
}

}  // namespace dflash
