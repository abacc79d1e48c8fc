// The gated RMSNorm of a GatedDeltaNet layer's output (gated_delta_rule.h: gated_rms_norm) as its own
// kernel; gdn_chunk_out.cu applies the same norm inside chunk_out (GatedNormOut). Reference:
// cpu::gated_rms_norm (src/ops/cpu/norm.cpp).
#include <stdexcept>
#include <string>

#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/gdn_common.cuh"

namespace dflash::cuda {

namespace {

using namespace detail;

/// Row r's z (row r = token r / heads, head r % heads): token rows z_stride apart.
__device__ __forceinline__ const bf16* z_row(const bf16* z, int64_t r, int heads, int64_t z_stride, int n) {
  return z + (r / heads) * z_stride + (r % heads) * int64_t(n);
}

/// A warp per row of n values: y = w * x * rsqrt(mean(x^2) + eps) * silu(z).
__global__ void gated_rms_norm_kernel(const float* x, const bf16* z, int heads, int64_t z_stride, const float* w,
                                      bf16* y, int64_t rows, int n, float eps) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float* xr = x + r * n;
  const bf16* zr = z_row(z, r, heads, z_stride, n);
  float ss = 0.f;
  for (int i = lane; i < n; i += 32) ss += xr[i] * xr[i];
  const float s = rsqrtf(warp_sum(ss) / float(n) + eps);
  for (int i = lane; i < n; i += 32)
    y[r * n + i] = __float2bfloat16_rn(gated_norm(w[i], xr[i], s, __bfloat162float(zr[i])));
}

/// The same for n = 128 V (x, w 16-byte aligned, z and y 8-byte): lane l holds columns 4 (l + 32 v)
/// .. + 3 (v < V), x and z loaded at once (2 V loads in flight per lane), y written 8 bytes per lane.
template <int V>
__global__ void gated_rms_norm_vec_kernel(const float* x, const bf16* z, int heads, int64_t z_stride, const float* w,
                                          bf16* y, int64_t rows, float eps) {
  constexpr int n = 128 * V;
  const int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float4 xv[V];
  uint2 zv[V];  // 4 bf16
#pragma unroll
  for (int v = 0; v < V; ++v) {
    xv[v] = reinterpret_cast<const float4*>(x + r * n)[lane + 32 * v];
    zv[v] = reinterpret_cast<const uint2*>(z_row(z, r, heads, z_stride, n))[lane + 32 * v];
  }
  float ss = 0.f;
#pragma unroll
  for (int v = 0; v < V; ++v) ss += xv[v].x * xv[v].x + xv[v].y * xv[v].y + xv[v].z * xv[v].z + xv[v].w * xv[v].w;
  const float s = rsqrtf(warp_sum(ss) / float(n) + eps);
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int i = 4 * (lane + 32 * v);
    const float4 wv = *reinterpret_cast<const float4*>(w + i);
    const float2 z01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zv[v].x));
    const float2 z23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zv[v].y));
    const __nv_bfloat162 lo =
        __floats2bfloat162_rn(gated_norm(wv.x, xv[v].x, s, z01.x), gated_norm(wv.y, xv[v].y, s, z01.y));
    const __nv_bfloat162 hi =
        __floats2bfloat162_rn(gated_norm(wv.z, xv[v].z, s, z23.x), gated_norm(wv.w, xv[v].w, s, z23.y));
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo), packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(y + r * n + i) = packed;
  }
}

}  // namespace

void gated_rms_norm(const float* x, const bf16* z, int64_t heads, int64_t z_stride, const float* w, bf16* y,
                    int64_t rows, int64_t n, double eps, cudaStream_t stream) {
  if (n <= 0 || rows < 0 || heads <= 0 || heads > INT32_MAX || z_stride < heads * n)
    throw std::invalid_argument("gated_rms_norm: rows " + std::to_string(rows) + ", n " + std::to_string(n) +
                                ", heads " + std::to_string(heads) + ", z row stride " + std::to_string(z_stride) +
                                " (>= heads n)");
  if (rows == 0) return;
  const unsigned blocks = unsigned((rows + 7) / 8);
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0 &&
                       (reinterpret_cast<uintptr_t>(z) | reinterpret_cast<uintptr_t>(y)) % 8 == 0 && z_stride % 4 == 0;
  if (aligned && n == 128)
    gated_rms_norm_vec_kernel<1><<<blocks, 256, 0, stream>>>(x, z, int(heads), z_stride, w, y, rows, float(eps));
  else if (aligned && n == 256)
    gated_rms_norm_vec_kernel<2><<<blocks, 256, 0, stream>>>(x, z, int(heads), z_stride, w, y, rows, float(eps));
  else
    gated_rms_norm_kernel<<<blocks, 256, 0, stream>>>(x, z, int(heads), z_stride, w, y, rows, int(n), float(eps));
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
