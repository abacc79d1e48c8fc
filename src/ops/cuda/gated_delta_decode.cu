// GatedDeltaNet kernels for decoding with a cache (see gated_delta_rule.h): the conv1d continuing each
// sequence's window, the window update, and the token-by-token recurrence with per-token states for
// speculative rollback. References: cpu::causal_conv1d_silu with a window, cpu::gated_delta_rule_recurrent
// (src/ops/cpu/gated_delta_rule.cpp) and TargetCache (src/models/target.cpp).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "ops/cuda/fast_math.cuh"
#include "ops/cuda/gated_delta_rule.h"

namespace dflash::cuda {

namespace {

__global__ void conv1d_silu_window_kernel(const bf16* __restrict__ x, int64_t x_stride, const float* __restrict__ w,
                                          const float* __restrict__ window, const int32_t* __restrict__ seq_of,
                                          const int32_t* __restrict__ cu, int64_t T, int64_t C, int K,
                                          float* __restrict__ y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i % C;
    const int s = seq_of[t];
    const int64_t start = cu[s];
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
      const int64_t src = t - K + 1 + j;  // >= start - (K - 1)
      const float xv = src >= start ? __bfloat162float(x[src * x_stride + c])
                                    : window[(int64_t(s) * (K - 1) + (K - 1) + (src - start)) * C + c];
      acc += w[c * K + j] * xv;
    }
    y[i] = fast_silu(acc);
  }
}

/// hist rows of sequence s: [s * (K-1) + cu[s], (s + 1) * (K-1) + cu[s + 1]): old window, new inputs.
__global__ void window_hist_kernel(const float* __restrict__ window, const bf16* __restrict__ x, int64_t x_stride,
                                   const int32_t* __restrict__ cu, int n_seq, int64_t C, int K, float* __restrict__ hist) {
  const int s = blockIdx.y;
  const int64_t rows = (K - 1) + (cu[s + 1] - cu[s]), base = int64_t(s) * (K - 1) + cu[s];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    hist[(base + r) * C + c] = r < K - 1 ? window[(int64_t(s) * (K - 1) + r) * C + c]
                                         : __bfloat162float(x[(cu[s] + r - (K - 1)) * x_stride + c]);
  }
}

__global__ void window_from_hist_kernel(const float* __restrict__ hist, const int32_t* __restrict__ cu, int64_t C, int K,
                                        float* __restrict__ window) {
  const int s = blockIdx.y;
  const int64_t n = cu[s + 1] - cu[s], base = int64_t(s) * (K - 1) + cu[s] + n;  // the last K-1 history rows
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(K - 1) * C;
       i += int64_t(gridDim.x) * blockDim.x)
    window[int64_t(s) * (K - 1) * C + i] = hist[base * C + i];
}

constexpr int kRecCols = 16;  // state columns per block; one thread per state row (dk <= 128)

/// red [4][kRecCols] <- per-warp sums of part; then out[c] = sum over warps (every thread reads it).
__device__ __forceinline__ void block_sum16(const float (&part)[kRecCols], float (*red)[kRecCols], float* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int c = 0; c < kRecCols; ++c) {
    float v = part[c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[warp][c] = v;
  }
  __syncthreads();
  if (threadIdx.x < kRecCols) out[threadIdx.x] = red[0][threadIdx.x] + red[1][threadIdx.x] + red[2][threadIdx.x] + red[3][threadIdx.x];
  __syncthreads();
}

/// One block of 128 threads per (sequence, value head, 16 state columns); thread m holds state row m.
__global__ void __launch_bounds__(128) recurrent_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                        const float* __restrict__ v, const float* __restrict__ g,
                                                        const float* __restrict__ beta, const int32_t* __restrict__ bounds,
                                                        int Hk, int Hv, int dk, int dv, float* __restrict__ state,
                                                        float* __restrict__ token_states, float* __restrict__ o) {
  __shared__ float red[4][kRecCols];
  __shared__ float kv[kRecCols], out[kRecCols];
  // The block's 128 x 16 slice of the state moves through shared memory, so that consecutive threads
  // read / write consecutive columns (whole sectors); one row per thread in registers (padded rows:
  // no bank conflicts).
  __shared__ float tile[128][kRecCols + 1];
  const int s = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * kRecCols, kh = h / (Hv / Hk), m = threadIdx.x;
  const bool row = m < dk;
  const int ncol = min(kRecCols, dv - c0);
  float* st = state + (int64_t(s) * Hv + h) * dk * dv;
  for (int i = threadIdx.x; i < dk * kRecCols; i += blockDim.x) {
    const int r = i / kRecCols, c = i % kRecCols;
    tile[r][c] = c < ncol ? st[int64_t(r) * dv + c0 + c] : 0.f;
  }
  __syncthreads();
  float S[kRecCols];
#pragma unroll
  for (int c = 0; c < kRecCols; ++c) S[c] = row ? tile[m][c] : 0.f;
  for (int64_t t = bounds[2 * s]; t < bounds[2 * s + 1]; ++t) {
    const float decay = expf(g[t * Hv + h]), b = beta[t * Hv + h];
    const float km = row ? k[(t * Hk + kh) * dk + m] : 0.f, qm = row ? q[(t * Hk + kh) * dk + m] : 0.f;
    const float* vt = v + (t * Hv + h) * dv + c0;
    float part[kRecCols];
#pragma unroll
    for (int c = 0; c < kRecCols; ++c) S[c] *= decay, part[c] = S[c] * km;
    block_sum16(part, red, kv);  // S^T k
#pragma unroll
    for (int c = 0; c < kRecCols; ++c) {
      const float u = c < ncol ? (vt[c] - kv[c]) * b : 0.f;
      S[c] += km * u;
      part[c] = S[c] * qm;
    }
    block_sum16(part, red, out);  // S^T q
    if (m < ncol) o[(t * Hv + h) * dv + c0 + m] = out[m];
    if (token_states && row) {
      float* ts = token_states + ((t * Hv + h) * dk + m) * dv + c0;
#pragma unroll
      for (int c = 0; c < kRecCols; ++c)
        if (c < ncol) ts[c] = S[c];
    }
  }
  if (row)
#pragma unroll
    for (int c = 0; c < kRecCols; ++c) tile[m][c] = S[c];
  __syncthreads();
  for (int i = threadIdx.x; i < dk * kRecCols; i += blockDim.x) {
    const int r = i / kRecCols, c = i % kRecCols;
    if (c < ncol) st[int64_t(r) * dv + c0 + c] = tile[r][c];
  }
}

void check_conv(int K, int64_t C, int64_t x_stride, const char* what) {
  if (K < 1 || K > 8 || C <= 0 || x_stride < C)
    throw std::invalid_argument(std::string(what) + ": kernel size " + std::to_string(K) + " (1..8), channels " +
                                std::to_string(C) + ", input row stride " + std::to_string(x_stride) +
                                " (>= channels)");
}

}  // namespace

void causal_conv1d_silu_window(const bf16* x, int64_t x_stride, const float* w, const float* window,
                               const int32_t* seq_of, const int32_t* cu, int64_t T, int64_t C, int K, float* y,
                               cudaStream_t stream) {
  check_conv(K, C, x_stride, "causal_conv1d_silu_window");
  if (T <= 0) return;
  conv1d_silu_window_kernel<<<grid_for(T * C), 256, 0, stream>>>(x, x_stride, w, window, seq_of, cu, T, C, K, y);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void conv_window_advance(float* window, const bf16* x, int64_t x_stride, const int32_t* cu, int n_seq, int64_t T,
                         int64_t C, int K, float* hist, cudaStream_t stream) {
  check_conv(K, C, x_stride, "conv_window_advance");
  if (n_seq <= 0 || K == 1) return;
  const unsigned blocks = unsigned(std::min<int64_t>((int64_t(K - 1 + T) * C + 255) / 256, 1024));
  window_hist_kernel<<<dim3(blocks, unsigned(n_seq)), 256, 0, stream>>>(window, x, x_stride, cu, n_seq, C, K, hist);
  DFLASH_CUDA_CHECK_LAUNCH();
  window_from_hist_kernel<<<dim3(unsigned((int64_t(K - 1) * C + 255) / 256), unsigned(n_seq)), 256, 0, stream>>>(
      hist, cu, C, K, window);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void gated_delta_rule_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                const std::vector<int64_t>& cu, int Hk, int Hv, int dk, int dv, float* state,
                                float* token_states, float* o, cudaStream_t stream, const std::vector<int64_t>& counts) {
  if (Hk <= 0 || Hv % Hk != 0 || dk <= 0 || dk > 128 || dv <= 0 || dv > 128 || cu.size() < 2 || cu.front() != 0)
    throw std::invalid_argument("gated_delta_rule_recurrent: Hk " + std::to_string(Hk) + ", Hv " + std::to_string(Hv) +
                                ", dk " + std::to_string(dk) + ", dv " + std::to_string(dv) + " (<= 128), " +
                                std::to_string(cu.size()) + " cu_seqlens entries");
  const int n_seq = int(cu.size()) - 1;
  if (!counts.empty() && counts.size() != size_t(n_seq))
    throw std::invalid_argument("gated_delta_rule_recurrent: " + std::to_string(counts.size()) + " counts for " +
                                std::to_string(n_seq) + " sequences");
  std::vector<int32_t> bounds;  // per sequence: first row, end row
  for (int q = 0; q < n_seq; ++q) {
    const int64_t len = cu[size_t(q) + 1] - cu[size_t(q)];
    if (len < 0) throw std::invalid_argument("gated_delta_rule_recurrent: cu_seqlens decrease");
    const int64_t n = counts.empty() ? len : counts[size_t(q)];
    if (n < 0 || n > len)
      throw std::invalid_argument("gated_delta_rule_recurrent: count " + std::to_string(n) + " of sequence " +
                                  std::to_string(q) + " outside [0, " + std::to_string(len) + "]");
    bounds.push_back(int32_t(cu[size_t(q)]));
    bounds.push_back(int32_t(cu[size_t(q)] + n));
  }
  auto d_bounds = upload(bounds, stream);
  const dim3 grid(unsigned(n_seq), unsigned(Hv), unsigned((dv + kRecCols - 1) / kRecCols));
  recurrent_kernel<<<grid, 128, 0, stream>>>(q, k, v, g, beta, d_bounds.data(), Hk, Hv, dk, dv, state, token_states, o);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
