#include <algorithm>
#include <stdexcept>

#include "gpu/vec.cuh"
#include "ops/cuda/rope.h"

namespace dflash::cuda {

namespace {

__global__ void rope_table_kernel(const int64_t* pos, const double* inv_freq, int64_t n, int64_t half, float* c,
                                  float* s, double scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * half; i += int64_t(gridDim.x) * blockDim.x) {
    const double ang = double(pos[i / half]) * inv_freq[i % half];
    double sv, cv;
    sincos(ang, &sv, &cv);
    c[i] = float(scale * cv);
    s[i] = float(scale * sv);
  }
}

__global__ void rope_apply_kernel(bf16* x, int64_t n, int64_t H, int64_t D, int64_t half, const float* c,
                                  const float* s, float sign) {
  const int64_t total = n * H * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = i % half, th = i / half, t = th / H;
    bf16* p = x + th * D;
    const float cc = c[t * half + j], ss = sign * s[t * half + j];
    const float a = __bfloat162float(p[j]), b = __bfloat162float(p[j + half]);
    p[j] = __float2bfloat16_rn(a * cc - b * ss);
    p[j + half] = __float2bfloat16_rn(b * cc + a * ss);
  }
}

// The same, 4 consecutive pairs per thread (half % 4 == 0, x 8-byte and the tables 16-byte
// aligned): 8-byte bf16 and 16-byte table accesses, one index division per 4 pairs.
__global__ void rope_apply4_kernel(bf16* x, int64_t n, int64_t H, int64_t D, int64_t half, const float* c,
                                   const float* s, float sign) {
  const int64_t q = half / 4, total = n * H * q;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t th = i / q, j = (i - th * q) * 4, t = th / H;
    bf16* p = x + th * D;
    float cc[4], ss[4], a[4], b[4], ra[4], rb[4];
    load4(c + t * half + j, cc);
    load4(s + t * half + j, ss);
    load4(p + j, a);
    load4(p + j + half, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      ss[k] *= sign;
      ra[k] = a[k] * cc[k] - b[k] * ss[k];
      rb[k] = b[k] * cc[k] + a[k] * ss[k];
    }
    store4(p + j, ra);
    store4(p + j + half, rb);
  }
}

}  // namespace

void rope_table(const int64_t* pos, const double* inv_freq, int64_t n, int64_t rot, float* cos, float* sin,
                cudaStream_t stream, double scale) {
  if (n < 0 || rot <= 0 || rot % 2) throw std::invalid_argument("rope_table: bad sizes");
  if (n == 0) return;
  rope_table_kernel<<<grid_for(n * rot / 2), 256, 0, stream>>>(pos, inv_freq, n, rot / 2, cos, sin, scale);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void rope_apply(bf16* x, int64_t n, int64_t H, int64_t D, int64_t rot, const float* cos, const float* sin,
                bool inverse, cudaStream_t stream) {
  if (n < 0 || H <= 0 || rot <= 0 || rot % 2 || rot > D) throw std::invalid_argument("rope_apply: bad sizes");
  if (n == 0) return;
  const int64_t half = rot / 2;
  if (half % 4 == 0 && D % 4 == 0 && aligned_to(8, x) && aligned_to(16, cos, sin))
    rope_apply4_kernel<<<grid_for(n * H * half / 4), 256, 0, stream>>>(x, n, H, D, half, cos, sin, inverse ? -1.f : 1.f);
  else
    rope_apply_kernel<<<grid_for(n * H * half), 256, 0, stream>>>(x, n, H, D, half, cos, sin, inverse ? -1.f : 1.f);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
