#include <algorithm>
#include <initializer_list>
#include <stdexcept>

#include "gpu/vec.cuh"
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

// Vectorized kernels: a row's chunks of E consecutive elements stay in registers between the two
// passes over it and move 4 * E bytes (bf16) or 8 * E bytes (fp32) per access; the weight-gradient
// partial sums of a thread's columns stay in registers too. Same math, same order per element as the
// scalar kernels above; only the order of the row sums differs. RowGroup<false>: a block per row,
// chunks of 8 (rows of n % 8 == 0, at most kThreads * 8 * CPT); RowGroup<true>: a warp per row,
// chunks of 4 (short rows, n % 4 == 0, at most 32 * 4 * CPT). Pointers 16-byte aligned.
template <bool kWarp>
struct RowGroup {
  static constexpr int E = kWarp ? 4 : 8;  // elements per chunk
  static constexpr int kLanes = kWarp ? 32 : kThreads;
  __device__ static int lane() { return kWarp ? int(threadIdx.x % 32) : int(threadIdx.x); }
  __device__ static int64_t first_row() {
    return kWarp ? int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32 : int64_t(blockIdx.x);
  }
  __device__ static int64_t row_step() { return int64_t(gridDim.x) * (kWarp ? kThreads / 32 : 1); }
  __device__ static float sum(float v, float* red) {
    if constexpr (kWarp) return warp_sum(v);
    else return block_sum(v, red);
  }
};

template <int E, typename T>
__device__ __forceinline__ void loadv(const T* p, float (&f)[E]) {
  if constexpr (E == 8) load8(p, f);
  else load4(p, f);
}
template <int E>
__device__ __forceinline__ void storev(bf16* p, const float (&f)[E]) {
  if constexpr (E == 8) store8(p, f);
  else store4(p, f);
}

template <typename X, bool kWarp, int CPT>
__global__ void __launch_bounds__(kThreads) rms_fwd_vec_kernel(const X* x, const float* w, bf16* y, float* inv,
                                                               int64_t rows, int n, float eps, bool zc) {
  using G = RowGroup<kWarp>;
  constexpr int E = G::E;
  __shared__ float red[kThreads / 32];
  const int nv = n / E, lane = G::lane();
  for (int64_t r = G::first_row(); r < rows; r += G::row_step()) {
    float v[CPT][E];
    float ss = 0;
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = lane + i * G::kLanes;
      if (c >= nv) continue;
      loadv<E>(x + r * n + E * c, v[i]);
#pragma unroll
      for (int k = 0; k < E; ++k) ss += v[i][k] * v[i][k];
    }
    const float iv = rsqrtf(G::sum(ss, red) / float(n) + eps);
    if (inv && lane == 0) inv[r] = iv;
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = lane + i * G::kLanes;
      if (c >= nv) continue;
      float g[E];
      loadv<E>(w + E * c, g);
#pragma unroll
      for (int k = 0; k < E; ++k) g[k] = (zc ? 1.f + g[k] : g[k]) * (v[i][k] * iv);
      storev<E>(y + r * n + E * c, g);
    }
  }
}

// partial[b, c] = block b's sum of dy * xh for column c (a warp per row: summed over the block's
// warps through shared memory acc_s [warps][n]).
template <bool kWarp, int CPT>
__global__ void __launch_bounds__(kThreads) rms_bwd_vec_kernel(const bf16* x, const float* w, const float* inv,
                                                               const bf16* dy, bf16* dx, float* partial, int64_t rows,
                                                               int n, bool zc) {
  using G = RowGroup<kWarp>;
  constexpr int E = G::E;
  __shared__ float red[kThreads / 32];
  extern __shared__ float acc_s[];
  const int nv = n / E, lane = G::lane();
  float acc[CPT][E];
#pragma unroll
  for (int i = 0; i < CPT; ++i)
#pragma unroll
    for (int k = 0; k < E; ++k) acc[i][k] = 0.f;
  for (int64_t r = G::first_row(); r < rows; r += G::row_step()) {
    const float iv = inv[r];
    float xh[CPT][E], d[CPT][E];
    float dot = 0;
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = lane + i * G::kLanes;
      if (c >= nv) continue;
      float g[E];
      loadv<E>(x + r * n + E * c, xh[i]);
      loadv<E>(dy + r * n + E * c, d[i]);
      loadv<E>(w + E * c, g);
#pragma unroll
      for (int k = 0; k < E; ++k) {
        xh[i][k] *= iv;
        dot += (zc ? 1.f + g[k] : g[k]) * d[i][k] * xh[i][k];
        acc[i][k] += d[i][k] * xh[i][k];
      }
    }
    if (!dx) continue;
    const float mean = G::sum(dot, red) / float(n);
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = lane + i * G::kLanes;
      if (c >= nv) continue;
      float g[E];
      loadv<E>(w + E * c, g);
#pragma unroll
      for (int k = 0; k < E; ++k) g[k] = iv * ((zc ? 1.f + g[k] : g[k]) * d[i][k] - xh[i][k] * mean);
      storev<E>(dx + r * n + E * c, g);
    }
  }
  if (!partial) return;
  float* out = kWarp ? acc_s + (threadIdx.x / 32) * n : partial + int64_t(blockIdx.x) * n;
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int c = lane + i * G::kLanes;
    if (c < nv)
#pragma unroll
      for (int k = 0; k < E; k += 4)
        *reinterpret_cast<float4*>(out + E * c + k) = make_float4(acc[i][k], acc[i][k + 1], acc[i][k + 2], acc[i][k + 3]);
  }
  if constexpr (kWarp) {
    __syncthreads();
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      float t = 0;
      for (int k = 0; k < kThreads / 32; ++k) t += acc_s[k * n + c];
      partial[int64_t(blockIdx.x) * n + c] = t;
    }
  }
}

/// The vectorized kernel for `chunks` (vec_chunks: 1..4 a block per row, -1 / -2 a warp per row).
template <typename X>
auto rms_fwd_vec(int chunks) {
  switch (chunks) {
    case 1: return rms_fwd_vec_kernel<X, false, 1>;
    case 2: return rms_fwd_vec_kernel<X, false, 2>;
    case 3: return rms_fwd_vec_kernel<X, false, 3>;
    case 4: return rms_fwd_vec_kernel<X, false, 4>;
    case -1: return rms_fwd_vec_kernel<X, true, 1>;
    default: return rms_fwd_vec_kernel<X, true, 2>;
  }
}
inline auto rms_bwd_vec(int chunks) {
  switch (chunks) {
    case 1: return rms_bwd_vec_kernel<false, 1>;
    case 2: return rms_bwd_vec_kernel<false, 2>;
    case 3: return rms_bwd_vec_kernel<false, 3>;
    case 4: return rms_bwd_vec_kernel<false, 4>;
    case -1: return rms_bwd_vec_kernel<true, 1>;
    default: return rms_bwd_vec_kernel<true, 2>;
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
int vec_chunks(int64_t n, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (!aligned_to(16, p)) return 0;
  if (n <= kWarpRowMax) return n % 4 == 0 && n <= 256 ? -int((n / 4 + 31) / 32) : 0;
  const int vpt = int((n / 8 + kThreads - 1) / kThreads);
  return n % 8 == 0 && vpt <= 4 ? vpt : 0;
}

template <typename X>
void rms_forward_impl(const X* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, double eps, bool zc,
                      cudaStream_t stream) {
  check_sizes(rows, n, "rms_norm_forward");
  if (rows == 0) return;
  const int vpt = vec_chunks(n, {x, w, y});
  if (vpt != 0) {
    const int grid = int(std::min<int64_t>(vpt > 0 ? rows : (rows + 7) / 8, 65535));
    rms_fwd_vec<X>(vpt)<<<grid, kThreads, 0, stream>>>(x, w, y, inv, rows, int(n), float(eps), zc);
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
  const int vpt = vec_chunks(n, {x, w, dy, dx, partial});
  if (vpt != 0) {
    const size_t smem = dw && vpt < 0 ? size_t(n) * sizeof(float) * (kThreads / 32) : 0;  // <= 8 KB
    rms_bwd_vec(vpt)<<<grid, kThreads, smem, stream>>>(x, w, inv, dy, dx, partial, rows, int(n), zero_centered);
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
