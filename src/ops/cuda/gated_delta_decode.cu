// GatedDeltaNet kernels for decoding with a cache (see gated_delta_rule.h): the conv1d continuing each
// sequence's window, the window update, and the token-by-token recurrence with per-token states for
// speculative rollback. References: cpu::causal_conv1d_silu with a window, cpu::gated_delta_rule_recurrent
// (src/ops/cpu/gated_delta_rule.cpp) and TargetCache (src/models/target.cpp).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "gpu/fast_math.cuh"
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

constexpr int kRecWarps = 8, kRecRows = 16;  // 8 warps x 16 state rows each: dk <= 128

/// One block of 256 threads per (sequence, value head, 32 state columns): lane l of warp w holds
/// column c0 + l of state rows [16 w, 16 w + 16) in registers, so a warp reads and writes a state row's
/// 32 columns as one 128-byte line, and S^T k and S^T q sum 16 rows in registers before one exchange
/// of the 8 warps' partial sums through shared memory. At least 4 blocks per SM (64 registers, no
/// spills; unbounded, ptxas took 167 and an SM held one block): the state streams from HBM, and one
/// block's 8 warps cannot keep enough loads in flight.
__global__ void __launch_bounds__(kRecWarps * 32, 4) recurrent_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                                   const float* __restrict__ v, const float* __restrict__ g,
                                                                   const float* __restrict__ beta,
                                                                   const int32_t* __restrict__ bounds, int Hk, int Hv,
                                                                   int dk, int dv, float* __restrict__ state,
                                                                   float* __restrict__ token_states, float* __restrict__ o) {
  __shared__ float red[kRecWarps][32];
  const int s = blockIdx.x, h = blockIdx.y, kh = h / (Hv / Hk), lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = blockIdx.z * 32 + lane, r0 = warp * kRecRows;
  const bool col = c < dv;
  const auto valid = [&](int i) { return col && r0 + i < dk; };
  float* st = state + (int64_t(s) * Hv + h) * dk * dv;
  float S[kRecRows];
#pragma unroll
  for (int i = 0; i < kRecRows; ++i) S[i] = valid(i) ? st[int64_t(r0 + i) * dv + c] : 0.f;
  // sum over the 8 warps of red[.][lane], after every warp wrote its part; red free again on return
  const auto block_sum = [&](float part) {
    red[warp][lane] = part;
    __syncthreads();
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kRecWarps; ++w) sum += red[w][lane];
    __syncthreads();
    return sum;
  };
  for (int64_t t = bounds[2 * s]; t < bounds[2 * s + 1]; ++t) {
    const float decay = expf(g[t * Hv + h]), b = beta[t * Hv + h];
    const float* kt = k + (t * Hk + kh) * dk + r0;  // the same address across a warp: one broadcast load
    const float* qt = q + (t * Hk + kh) * dk + r0;
    float kr[kRecRows], part = 0.f;
#pragma unroll
    for (int i = 0; i < kRecRows; ++i) {
      kr[i] = r0 + i < dk ? kt[i] : 0.f;
      S[i] *= decay;
      part += S[i] * kr[i];
    }
    const float kv = block_sum(part);  // (S^T k)[c]
    const float u = col ? (v[(t * Hv + h) * dv + c] - kv) * b : 0.f;
    part = 0.f;
#pragma unroll
    for (int i = 0; i < kRecRows; ++i) {
      S[i] += kr[i] * u;
      part += S[i] * (r0 + i < dk ? qt[i] : 0.f);
    }
    const float out = block_sum(part);  // (S^T q)[c]
    if (warp == 0 && col) o[(t * Hv + h) * dv + c] = out;
    if (token_states) {
      float* ts = token_states + ((t * Hv + h) * dk + r0) * dv + c;
#pragma unroll
      for (int i = 0; i < kRecRows; ++i)
        if (valid(i)) ts[int64_t(i) * dv] = S[i];
    }
  }
#pragma unroll
  for (int i = 0; i < kRecRows; ++i)
    if (valid(i)) st[int64_t(r0 + i) * dv + c] = S[i];
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
  const dim3 grid(unsigned(n_seq), unsigned(Hv), unsigned((dv + 31) / 32));
  recurrent_kernel<<<grid, kRecWarps * 32, 0, stream>>>(q, k, v, g, beta, d_bounds.data(), Hk, Hv, dk, dv, state, token_states, o);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
