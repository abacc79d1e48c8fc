#include <algorithm>
#include <stdexcept>

#include "ops/cuda/elementwise.h"

namespace dflash::cuda {

namespace {

int grid_for(int64_t n) { return int(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 65535 * 4))); }

#define DFLASH_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__global__ void swiglu_fwd_kernel(const bf16* g, const bf16* u, bf16* a, int64_t n) {
  DFLASH_GRID_STRIDE(i, n) {
    const float gv = __bfloat162float(g[i]);
    a[i] = __float2bfloat16_rn(gv / (1.f + __expf(-gv)) * __bfloat162float(u[i]));
  }
}

__global__ void swiglu_bwd_kernel(const bf16* g, const bf16* u, const bf16* da, bf16* dg, bf16* du, int64_t n) {
  DFLASH_GRID_STRIDE(i, n) {
    const float gv = __bfloat162float(g[i]), uv = __bfloat162float(u[i]), d = __bfloat162float(da[i]);
    const float s = 1.f / (1.f + __expf(-gv));
    dg[i] = __float2bfloat16_rn(d * uv * s * (1.f + gv * (1.f - s)));
    du[i] = __float2bfloat16_rn(d * gv * s);
  }
}

__global__ void gather_kernel(const bf16* table, int64_t V, int64_t d, const int32_t* ids, int64_t rows, bf16* out,
                              int* bad) {
  DFLASH_GRID_STRIDE(i, rows * d) {
    const int64_t r = i / d, c = i % d;
    const int32_t id = ids[r];
    if (id < 0 || id >= V) {
      out[i] = __float2bfloat16_rn(__int_as_float(0x7fc00000));
      if (bad) *bad = 1;
    } else {
      out[i] = table[int64_t(id) * d + c];
    }
  }
}

__global__ void add_kernel(bf16* y, const bf16* x, int64_t n) {
  DFLASH_GRID_STRIDE(i, n) y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + __bfloat162float(x[i]));
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__global__ void normal_kernel(T* x, int64_t n, uint64_t seed, float mean, float sd) {
  DFLASH_GRID_STRIDE(i, n) {
    const uint64_t h = splitmix64(seed ^ splitmix64(uint64_t(i)));
    const float u1 = (float(uint32_t(h >> 40)) + 0.5f) * 0x1.0p-24f, u2 = float(uint32_t(h & 0xFFFFFF)) * 0x1.0p-24f;
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    x[i] = T(mean + sd * z);
  }
}

}  // namespace

void fill_normal(float* x, int64_t n, uint64_t seed, float mean, float sd, cudaStream_t stream) {
  if (n <= 0) return;
  normal_kernel<float><<<grid_for(n), 256, 0, stream>>>(x, n, seed, mean, sd);
  DFLASH_CUDA_CHECK_LAUNCH();
}
void fill_normal(bf16* x, int64_t n, uint64_t seed, float mean, float sd, cudaStream_t stream) {
  if (n <= 0) return;
  normal_kernel<bf16><<<grid_for(n), 256, 0, stream>>>(x, n, seed, mean, sd);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void swiglu_forward(const bf16* gate, const bf16* up, bf16* act, int64_t n, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("swiglu_forward: negative size");
  if (n == 0) return;
  swiglu_fwd_kernel<<<grid_for(n), 256, 0, stream>>>(gate, up, act, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const bf16* gate, const bf16* up, const bf16* dact, bf16* dgate, bf16* dup, int64_t n,
                     cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("swiglu_backward: negative size");
  if (n == 0) return;
  swiglu_bwd_kernel<<<grid_for(n), 256, 0, stream>>>(gate, up, dact, dgate, dup, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void embedding_gather(const bf16* table, int64_t V, int64_t d, const int32_t* ids, int64_t rows, bf16* out, int* bad_id,
                      cudaStream_t stream) {
  if (V <= 0 || d <= 0 || rows < 0) throw std::invalid_argument("embedding_gather: bad sizes");
  if (rows == 0) return;
  gather_kernel<<<grid_for(rows * d), 256, 0, stream>>>(table, V, d, ids, rows, out, bad_id);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void add_inplace(bf16* y, const bf16* x, int64_t n, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("add_inplace: negative size");
  if (n == 0) return;
  add_kernel<<<grid_for(n), 256, 0, stream>>>(y, x, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
