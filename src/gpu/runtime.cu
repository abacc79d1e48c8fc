#include <cstdio>
#include <stdexcept>
#include <string>

#include "gpu/runtime.h"

namespace dflash::cuda {

void check(cudaError_t e, const char* expr, const char* file, int line) {
  if (e == cudaSuccess) return;
  throw std::runtime_error(std::string("CUDA error: ") + expr + " at " + file + ":" + std::to_string(line) + ": " +
                           cudaGetErrorString(e));
}

std::string out_of_memory_message(int device, size_t asked, size_t free, size_t total, size_t pool_reserved) {
  char b[256];
  std::snprintf(b, sizeof b,
                "out of GPU memory on cuda:%d: %.2f GB asked with %.2f GB free of %.2f GB (%.2f GB held by the "
                "stream-ordered pool)",
                device, double(asked) / 1e9, double(free) / 1e9, double(total) / 1e9, double(pool_reserved) / 1e9);
  return b;
}

void check_alloc(cudaError_t e, size_t bytes, const char* expr, const char* file, int line) {
  if (e != cudaErrorMemoryAllocation) return check(e, expr, file, line);
  cudaGetLastError();  // (not sticky: the device stays usable)
  int device = -1;
  size_t free = 0, total = 0;
  uint64_t reserved = 0;
  cudaMemPool_t pool;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaMemGetInfo(&free, &total);
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess)
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved);
  }
  cudaGetLastError();
  throw std::runtime_error(out_of_memory_message(device, bytes, free, total, size_t(reserved)) + " (" + expr + " at " +
                           file + ":" + std::to_string(line) + "): the run needs more memory than this GPU has left");
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
