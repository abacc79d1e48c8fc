#include <algorithm>
#include <stdexcept>

#include "ops/cuda/norm.h"
#include "ops/cuda/vec.cuh"

namespace dflash::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxPartialBlocks = 1024;  // row groups of the dw reduction (enough blocks to fill the GPU)

/// Sum over the block (all threads get the result). `red` holds kThreads / 32 floats.
__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red may still be read from the previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0;
  for (int i = 0; i < int(blockDim.x / 32); ++i) s += red[i];
  return s;
}

__device__ __forceinline__ float gain(const float* w, int64_t c, bool zc) { return zc ? 1.f + w[c] : w[c]; }

__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }

template <typename X>
__global__ void rms_fwd_kernel(const X* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, float eps,
                               bool zc) {
  __shared__ float red[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const X* xr = x + r * n;
    float ss = 0;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const float v = to_f(xr[c]);
      ss += v * v;
    }
    const float iv = rsqrtf(block_sum(ss, red) / float(n) + eps);
    if (inv && threadIdx.x == 0) inv[r] = iv;
    bf16* yr = y + r * n;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) yr[c] = __float2bfloat16_rn(gain(w, c, zc) * (to_f(xr[c]) * iv));
  }
}

// Block b handles rows b, b + G, ...; partial[b, c] = its sum of dy * xh for column c.
__global__ void rms_bwd_kernel(const bf16* x, const float* w, const float* inv, const bf16* dy, bf16* dx,
                               float* partial, int64_t rows, int64_t n, bool zc) {
  __shared__ float red[kThreads / 32];
  extern __shared__ float acc[];  // [n] when partial != nullptr
  if (partial)
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) acc[c] = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const bf16* xr = x + r * n;
    const bf16* dyr = dy + r * n;
    const float iv = inv[r];
    float dot = 0;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const float xh = __bfloat162float(xr[c]) * iv, d = __bfloat162float(dyr[c]);
      dot += gain(w, c, zc) * d * xh;
      if (partial) acc[c] += d * xh;  // each thread owns its columns: no race
    }
    if (dx) {
      const float mean = block_sum(dot, red) / float(n);
      bf16* dxr = dx + r * n;
      for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
        const float xh = __bfloat162float(xr[c]) * iv;
        dxr[c] = __float2bfloat16_rn(iv * (gain(w, c, zc) * __bfloat162float(dyr[c]) - xh * mean));
      }
    }
  }
  if (partial)
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) partial[blockIdx.x * n + c] = acc[c];
}

// Short rows (per-head q_norm / k_norm, n <= kWarpRowMax): one warp per row, 8 rows per block.
constexpr int kWarpRowMax = 1024;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename X>
__global__ void rms_fwd_warp_kernel(const X* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n,
                                    float eps, bool zc) {
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, wpb = blockDim.x / 32;
  for (int64_t r = int64_t(blockIdx.x) * wpb + wid; r < rows; r += int64_t(gridDim.x) * wpb) {
    const X* xr = x + r * n;
    float ss = 0;
    for (int64_t c = lane; c < n; c += 32) {
      const float v = to_f(xr[c]);
      ss += v * v;
    }
    const float iv = rsqrtf(warp_sum(ss) / float(n) + eps);
    if (inv && lane == 0) inv[r] = iv;
    bf16* yr = y + r * n;
    for (int64_t c = lane; c < n; c += 32) yr[c] = __float2bfloat16_rn(gain(w, c, zc) * (to_f(xr[c]) * iv));
  }
}

// partial[b, c] = block b's sum of dy * xh (per-warp accumulators in smem [warps][n], then summed).
__global__ void rms_bwd_warp_kernel(const bf16* x, const float* w, const float* inv, const bf16* dy, bf16* dx,
                                    float* partial, int64_t rows, int64_t n, bool zc) {
  extern __shared__ float acc[];  // [warps][n] when partial != nullptr
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, wpb = blockDim.x / 32;
  float* my = acc + wid * n;
  if (partial)
    for (int64_t c = lane; c < n; c += 32) my[c] = 0;
  for (int64_t r = int64_t(blockIdx.x) * wpb + wid; r < rows; r += int64_t(gridDim.x) * wpb) {
    const bf16* xr = x + r * n;
    const bf16* dyr = dy + r * n;
    const float iv = inv[r];
    float dot = 0;
    for (int64_t c = lane; c < n; c += 32) {
      const float xh = __bfloat162float(xr[c]) * iv, d = __bfloat162float(dyr[c]);
      dot += gain(w, c, zc) * d * xh;
      if (partial) my[c] += d * xh;
    }
    if (dx) {
      const float mean = warp_sum(dot) / float(n);
      bf16* dxr = dx + r * n;
      for (int64_t c = lane; c < n; c += 32) {
        const float xh = __bfloat162float(xr[c]) * iv;
        dxr[c] = __float2bfloat16_rn(iv * (gain(w, c, zc) * __bfloat162float(dyr[c]) - xh * mean));
      }
    }
  }
  if (!partial) return;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    float t = 0;
    for (int k = 0; k < wpb; ++k) t += acc[k * n + c];
    partial[blockIdx.x * n + c] = t;
  }
}

// Vectorized kernels (rows of n % 8 == 0 elements, 16-byte aligned, at most kThreads * 8 * VPT per
// block row): each thread keeps its VPT chunks of 8 consecutive elements in registers between the
// two passes over a row and reads / writes them 16 bytes (bf16) or 2 x 16 bytes (fp32) at a time; the
// weight-gradient partial sums of its columns stay in registers too. Same math, same order per
// element as the scalar kernels above; only the order of the row sums differs.
template <typename X, int VPT>
__global__ void __launch_bounds__(kThreads) rms_fwd_vec_kernel(const X* x, const float* w, bf16* y, float* inv,
                                                               int64_t rows, int n, float eps, bool zc) {
  __shared__ float red[kThreads / 32];
  const int nv = n / 8;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float v[VPT][8];
    float ss = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = int(threadIdx.x) + i * kThreads;
      if (c >= nv) continue;
      load8(x + r * n + 8 * c, v[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) ss += v[i][k] * v[i][k];
    }
    const float iv = rsqrtf(block_sum(ss, red) / float(n) + eps);
    if (inv && threadIdx.x == 0) inv[r] = iv;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = int(threadIdx.x) + i * kThreads;
      if (c >= nv) continue;
      float g[8];
      load8(w + 8 * c, g);
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] = (zc ? 1.f + g[k] : g[k]) * (v[i][k] * iv);
      store8(y + r * n + 8 * c, g);
    }
  }
}

// Block b handles rows b, b + G, ...; partial[b, c] = its sum of dy * xh for column c.
template <int VPT>
__global__ void __launch_bounds__(kThreads) rms_bwd_vec_kernel(const bf16* x, const float* w, const float* inv,
                                                               const bf16* dy, bf16* dx, float* partial, int64_t rows,
                                                               int n, bool zc) {
  __shared__ float red[kThreads / 32];
  const int nv = n / 8;
  float acc[VPT][8];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[i][k] = 0.f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float iv = inv[r];
    float xh[VPT][8], d[VPT][8];
    float dot = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = int(threadIdx.x) + i * kThreads;
      if (c >= nv) continue;
      float g[8];
      load8(x + r * n + 8 * c, xh[i]);
      load8(dy + r * n + 8 * c, d[i]);
      load8(w + 8 * c, g);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        xh[i][k] *= iv;
        dot += (zc ? 1.f + g[k] : g[k]) * d[i][k] * xh[i][k];
        acc[i][k] += d[i][k] * xh[i][k];
      }
    }
    if (!dx) continue;
    const float mean = block_sum(dot, red) / float(n);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = int(threadIdx.x) + i * kThreads;
      if (c >= nv) continue;
      float g[8];
      load8(w + 8 * c, g);
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] = iv * ((zc ? 1.f + g[k] : g[k]) * d[i][k] - xh[i][k] * mean);
      store8(dx + r * n + 8 * c, g);
    }
  }
  if (!partial) return;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = int(threadIdx.x) + i * kThreads;
    if (c >= nv) continue;
    float4* p = reinterpret_cast<float4*>(partial + int64_t(blockIdx.x) * n + 8 * c);
    p[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    p[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
  }
}

// Short rows (n <= kWarpRowMax, n % 4 == 0, at most 32 * 4 * WPT): one warp per row, as the scalar
// warp kernels, each lane holding WPT chunks of 4 consecutive elements (8 or 16 bytes a load).
template <typename X, int WPT>
__global__ void __launch_bounds__(kThreads) rms_fwd_warp_vec_kernel(const X* x, const float* w, bf16* y, float* inv,
                                                                    int64_t rows, int n, float eps, bool zc) {
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, wpb = blockDim.x / 32, nv = n / 4;
  for (int64_t r = int64_t(blockIdx.x) * wpb + wid; r < rows; r += int64_t(gridDim.x) * wpb) {
    float v[WPT][4];
    float ss = 0;
#pragma unroll
    for (int i = 0; i < WPT; ++i) {
      const int c = lane + 32 * i;
      if (c >= nv) continue;
      load4(x + r * n + 4 * c, v[i]);
#pragma unroll
      for (int k = 0; k < 4; ++k) ss += v[i][k] * v[i][k];
    }
    const float iv = rsqrtf(warp_sum(ss) / float(n) + eps);
    if (inv && lane == 0) inv[r] = iv;
#pragma unroll
    for (int i = 0; i < WPT; ++i) {
      const int c = lane + 32 * i;
      if (c >= nv) continue;
      float g[4];
      load4(w + 4 * c, g);
#pragma unroll
      for (int k = 0; k < 4; ++k) g[k] = (zc ? 1.f + g[k] : g[k]) * (v[i][k] * iv);
      store4(y + r * n + 4 * c, g);
    }
  }
}

// partial[b, c] = block b's sum of dy * xh (per-lane sums in registers, then over the warps in smem).
template <int WPT>
__global__ void __launch_bounds__(kThreads) rms_bwd_warp_vec_kernel(const bf16* x, const float* w, const float* inv,
                                                                    const bf16* dy, bf16* dx, float* partial,
                                                                    int64_t rows, int n, bool zc) {
  extern __shared__ float acc_s[];  // [warps][n] when partial != nullptr
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32, wpb = blockDim.x / 32, nv = n / 4;
  float acc[WPT][4];
#pragma unroll
  for (int i = 0; i < WPT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  for (int64_t r = int64_t(blockIdx.x) * wpb + wid; r < rows; r += int64_t(gridDim.x) * wpb) {
    const float iv = inv[r];
    float xh[WPT][4], d[WPT][4];
    float dot = 0;
#pragma unroll
    for (int i = 0; i < WPT; ++i) {
      const int c = lane + 32 * i;
      if (c >= nv) continue;
      float g[4];
      load4(x + r * n + 4 * c, xh[i]);
      load4(dy + r * n + 4 * c, d[i]);
      load4(w + 4 * c, g);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        xh[i][k] *= iv;
        dot += (zc ? 1.f + g[k] : g[k]) * d[i][k] * xh[i][k];
        acc[i][k] += d[i][k] * xh[i][k];
      }
    }
    if (!dx) continue;
    const float mean = warp_sum(dot) / float(n);
#pragma unroll
    for (int i = 0; i < WPT; ++i) {
      const int c = lane + 32 * i;
      if (c >= nv) continue;
      float g[4];
      load4(w + 4 * c, g);
#pragma unroll
      for (int k = 0; k < 4; ++k) g[k] = iv * ((zc ? 1.f + g[k] : g[k]) * d[i][k] - xh[i][k] * mean);
      store4(dx + r * n + 4 * c, g);
    }
  }
  if (!partial) return;
#pragma unroll
  for (int i = 0; i < WPT; ++i) {
    const int c = lane + 32 * i;
    if (c < nv)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc_s[wid * n + 4 * c + k] = acc[i][k];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    float t = 0;
    for (int k = 0; k < wpb; ++k) t += acc_s[k * n + c];
    partial[int64_t(blockIdx.x) * n + c] = t;
  }
}

// dw[c] += sum_b partial[b, c]. Block (32 x 8) owns 32 columns; thread (x, y) sums rows y, y + 8, ...,
// then the 8 partial sums are added in a fixed order (deterministic).
__global__ void column_sum_kernel(const float* partial, int blocks, int64_t n, float* dw) {
  __shared__ float red[8][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  float s = 0;
  if (c < n)
    for (int b = threadIdx.y; b < blocks; b += 8) s += partial[b * n + c];
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
    float t = 0;
    for (int y = 0; y < 8; ++y) t += red[y][threadIdx.x];
    dw[c] += t;
  }
}

int partial_blocks(int64_t rows) { return int(std::min<int64_t>(rows, kMaxPartialBlocks)); }

void check_sizes(int64_t rows, int64_t n, const char* what) {
  if (rows < 0 || n <= 0) throw std::invalid_argument(std::string(what) + ": bad shape");
}

}  // namespace

int64_t rms_norm_workspace_floats(int64_t rows, int64_t n) { return int64_t(partial_blocks(std::max<int64_t>(rows, 1))) * n; }

namespace {
/// Which kernel handles rows of n elements: the vectorized ones (chunks per thread, 1..4: rows of
/// n > kWarpRowMax, n % 8 == 0, n <= kThreads * 32; chunks per lane, -1 or -2: warp rows of
/// n % 4 == 0, n <= 256), or 0 for the scalar kernels (other sizes, or a pointer not 16-byte aligned).
int vec_chunks(int64_t n, const void* a, const void* b, const void* c, const void* d = nullptr) {
  if (!aligned_to(16, a, b, c, d)) return 0;
  if (n <= kWarpRowMax) return n % 4 == 0 && n <= 256 ? -int((n / 4 + 31) / 32) : 0;
  const int vpt = int((n / 8 + kThreads - 1) / kThreads);
  return n % 8 == 0 && vpt <= 4 ? vpt : 0;
}

template <typename X>
void rms_forward_impl(const X* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, double eps, bool zc,
                      cudaStream_t stream) {
  check_sizes(rows, n, "rms_norm_forward");
  if (rows == 0) return;
  const int vpt = vec_chunks(n, x, w, y);
  if (vpt > 0) {
    const int grid = int(std::min<int64_t>(rows, 65535));
    const auto kernel = vpt == 1   ? rms_fwd_vec_kernel<X, 1>
                        : vpt == 2 ? rms_fwd_vec_kernel<X, 2>
                        : vpt == 3 ? rms_fwd_vec_kernel<X, 3>
                                   : rms_fwd_vec_kernel<X, 4>;
    kernel<<<grid, kThreads, 0, stream>>>(x, w, y, inv, rows, int(n), float(eps), zc);
  } else if (vpt < 0) {
    const int grid = int(std::min<int64_t>((rows + 7) / 8, 65535));
    const auto kernel = vpt == -1 ? rms_fwd_warp_vec_kernel<X, 1> : rms_fwd_warp_vec_kernel<X, 2>;
    kernel<<<grid, kThreads, 0, stream>>>(x, w, y, inv, rows, int(n), float(eps), zc);
  } else if (n <= kWarpRowMax) {
    const int grid = int(std::min<int64_t>((rows + 7) / 8, 65535));
    rms_fwd_warp_kernel<X><<<grid, kThreads, 0, stream>>>(x, w, y, inv, rows, n, float(eps), zc);
  } else {
    const int grid = int(std::min<int64_t>(rows, 65535));
    rms_fwd_kernel<X><<<grid, kThreads, 0, stream>>>(x, w, y, inv, rows, n, float(eps), zc);
  }
  DFLASH_CUDA_CHECK_LAUNCH();
}
}  // namespace

void rms_norm_forward(const bf16* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, double eps,
                      bool zero_centered, cudaStream_t stream) {
  rms_forward_impl(x, w, y, inv, rows, n, eps, zero_centered, stream);
}
void rms_norm_forward(const float* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, double eps,
                      bool zero_centered, cudaStream_t stream) {
  rms_forward_impl(x, w, y, inv, rows, n, eps, zero_centered, stream);
}

void rms_norm_backward(const bf16* x, const float* w, const float* inv, const bf16* dy, bf16* dx, float* dw,
                       float* workspace, int64_t rows, int64_t n, bool zero_centered, cudaStream_t stream) {
  check_sizes(rows, n, "rms_norm_backward");
  if (rows == 0) return;
  const int grid = dw ? partial_blocks(rows) : int(std::min<int64_t>(rows, 65535));
  float* partial = dw ? workspace : nullptr;
  const int vpt = vec_chunks(n, x, w, dy, dx);
  if (vpt > 0) {
    const auto kernel = vpt == 1   ? rms_bwd_vec_kernel<1>
                        : vpt == 2 ? rms_bwd_vec_kernel<2>
                        : vpt == 3 ? rms_bwd_vec_kernel<3>
                                   : rms_bwd_vec_kernel<4>;
    kernel<<<grid, kThreads, 0, stream>>>(x, w, inv, dy, dx, partial, rows, int(n), zero_centered);
  } else if (vpt < 0) {
    const size_t smem = dw ? size_t(n) * sizeof(float) * (kThreads / 32) : 0;  // <= 8 KB
    const auto kernel = vpt == -1 ? rms_bwd_warp_vec_kernel<1> : rms_bwd_warp_vec_kernel<2>;
    kernel<<<grid, kThreads, smem, stream>>>(x, w, inv, dy, dx, partial, rows, int(n), zero_centered);
  } else {
    const bool warp_rows = n <= kWarpRowMax;
    const size_t smem = dw ? size_t(n) * sizeof(float) * (warp_rows ? kThreads / 32 : 1) : 0;
    if (smem > 200 * 1024) throw std::invalid_argument("rms_norm_backward: rows longer than 51200 are not supported");
    const auto kernel = warp_rows ? rms_bwd_warp_kernel : rms_bwd_kernel;
    if (smem > 48 * 1024)
      DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<grid, kThreads, smem, stream>>>(x, w, inv, dy, dx, partial, rows, n, zero_centered);
  }
  DFLASH_CUDA_CHECK_LAUNCH();
  if (dw) {
    column_sum_kernel<<<int((n + 31) / 32), dim3(32, 8), 0, stream>>>(workspace, grid, n, dw);
    DFLASH_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace dflash::cuda
