// Whether this build has the CUDA backend, asked at run time instead of #ifdef: with CUDA the GPU
// halves (src/*/cuda/) are linked; without, each folder's no_cuda.cpp defines the same entry points
// (CUDA-free declarations) and refuses with no_cuda_backend's message.
#pragma once
#include <string>

namespace dflash {

/// True in a build configured with CUDA (src/gpu/backend.cpp; src/gpu/no_cuda.cpp: false).
bool cuda_backend_built();

/// What a CPU-only build says to a GPU request: "<what>: this build has no CUDA backend (...)".
inline std::string no_cuda_backend(const std::string& what) {
  return what + ": this build has no CUDA backend (it was configured with -DDFLASH_CUDA=OFF or without nvcc; "
                "reconfigure on a machine with the CUDA toolkit)";
}

}  // namespace dflash
