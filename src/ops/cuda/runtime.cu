#include <stdexcept>
#include <string>

#include "ops/cuda/runtime.h"

namespace dflash::cuda {

void check(cudaError_t e, const char* expr, const char* file, int line) {
  if (e == cudaSuccess) return;
  throw std::runtime_error(std::string("CUDA error: ") + expr + " at " + file + ":" + std::to_string(line) + ": " +
                           cudaGetErrorString(e));
}

bool has_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

void require_device(const std::string& what, int index) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(what + ": no usable CUDA device (" + cudaGetErrorString(e) + ")");
  }
  if (index < 0 || index >= n)
    throw std::runtime_error(what + ": no CUDA device " + std::to_string(index) + " (" + std::to_string(n) +
                             " visible)");
}

namespace {
__global__ void f32_to_bf16_kernel(const float* in, bf16* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void bf16_to_f32_kernel(const bf16* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}
}  // namespace

void f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  f32_to_bf16_kernel<<<grid_for(n), 256, 0, stream>>>(in, out, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}
void bf16_to_f32(const bf16* in, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  bf16_to_f32_kernel<<<grid_for(n), 256, 0, stream>>>(in, out, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
