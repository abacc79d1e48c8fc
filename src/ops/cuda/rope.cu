#include <algorithm>
#include <stdexcept>

#include "ops/cuda/rope.h"

namespace dflash::cuda {

namespace {

__global__ void rope_table_kernel(const int64_t* pos, const double* inv_freq, int64_t n, int64_t half, float* c,
                                  float* s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * half; i += int64_t(gridDim.x) * blockDim.x) {
    const double ang = double(pos[i / half]) * inv_freq[i % half];
    double sv, cv;
    sincos(ang, &sv, &cv);
    c[i] = float(cv);
    s[i] = float(sv);
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

}  // namespace

void rope_table(const int64_t* pos, const double* inv_freq, int64_t n, int64_t rot, float* cos, float* sin,
                cudaStream_t stream) {
  if (n < 0 || rot <= 0 || rot % 2) throw std::invalid_argument("rope_table: bad sizes");
  if (n == 0) return;
  rope_table_kernel<<<grid_for(n * rot / 2), 256, 0, stream>>>(pos, inv_freq, n, rot / 2, cos, sin);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void rope_apply(bf16* x, int64_t n, int64_t H, int64_t D, int64_t rot, const float* cos, const float* sin,
                bool inverse, cudaStream_t stream) {
  if (n < 0 || H <= 0 || rot <= 0 || rot % 2 || rot > D) throw std::invalid_argument("rope_apply: bad sizes");
  if (n == 0) return;
  rope_apply_kernel<<<grid_for(n * H * rot / 2), 256, 0, stream>>>(x, n, H, D, rot / 2, cos, sin,
                                                                   inverse ? -1.f : 1.f);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
