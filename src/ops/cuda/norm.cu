#include <algorithm>
#include <stdexcept>

#include "ops/cuda/norm.h"

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
template <typename X>
void rms_forward_impl(const X* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, double eps, bool zc,
                      cudaStream_t stream) {
  check_sizes(rows, n, "rms_norm_forward");
  if (rows == 0) return;
  if (n <= kWarpRowMax) {
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
  const bool warp_rows = n <= kWarpRowMax;
  const size_t smem = dw ? size_t(n) * sizeof(float) * (warp_rows ? kThreads / 32 : 1) : 0;
  if (smem > 200 * 1024) throw std::invalid_argument("rms_norm_backward: rows longer than 51200 are not supported");
  const int grid = dw ? partial_blocks(rows) : int(std::min<int64_t>(rows, 65535));
  if (warp_rows) {
    if (smem > 48 * 1024)
      DFLASH_CUDA_CHECK(cudaFuncSetAttribute(rms_bwd_warp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    rms_bwd_warp_kernel<<<grid, kThreads, smem, stream>>>(x, w, inv, dy, dx, dw ? workspace : nullptr, rows, n,
                                                          zero_centered);
  } else {
    if (smem > 48 * 1024)
      DFLASH_CUDA_CHECK(cudaFuncSetAttribute(rms_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    rms_bwd_kernel<<<grid, kThreads, smem, stream>>>(x, w, inv, dy, dx, dw ? workspace : nullptr, rows, n, zero_centered);
  }
  DFLASH_CUDA_CHECK_LAUNCH();
  if (dw) {
    column_sum_kernel<<<int((n + 31) / 32), dim3(32, 8), 0, stream>>>(workspace, grid, n, dw);
    DFLASH_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace dflash::cuda
