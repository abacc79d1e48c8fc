// GatedDeltaNet kernels (see gated_delta_rule.h). The chunked forward, per chunk of L <= 64 tokens of
// one sequence and value head, with G_i = sum_{j<=i} g_j inside the chunk and S0 the state before it:
//   A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i),  T = (I + A)^-1  (forward substitution)
//   w = T diag(beta exp(G)) K,  u = T diag(beta) V                          (kernel chunk_prepare)
//   U = u - w S0                                 (the chunk's beta_t (v_t - S_{t-1}^T k_t), all t)
//   O = diag(exp(G)) Q S0 + P U,  P_ij = exp(G_i - G_j) q_i.k_j (j <= i)
//   S = exp(G_L) S0 + (diag(exp(G_L - G)) K)^T U                            (kernel chunk_scan)
// which unrolls the token recurrence exactly (flash-linear-attention's chunk_gated_delta_rule).
// chunk_prepare runs every (chunk, value head) in parallel; chunk_scan walks the chunks of one
// sequence in order, per (sequence, value head, 32 state columns). Both in fp32 (SIMT), as are the
// layer's activations between the projections' GEMMs (conv1d, q / k / v, o): bf16 only feeds GEMMs.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "ops/cuda/gated_delta_rule.h"

namespace dflash::cuda {

namespace {

constexpr int kChunk = 64;      // tokens per chunk
constexpr int kCols = 32;       // state columns (value features) per chunk_scan block
constexpr int kThreads = 256;

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

__global__ void conv1d_silu_kernel(const float* x, const float* w, const int32_t* row_start, int64_t T, int64_t C,
                                   int K, float* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i % C, b = row_start[t];
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
      const int64_t src = t - K + 1 + j;
      if (src >= b) acc += w[c * K + j] * x[src * C + c];
    }
    y[i] = silu(acc);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// One block per token: a warp per q / k head (l2norm), then v and the gates.
__global__ void gdn_prepare_kernel(const float* qkv, const float* b, const float* a, const float* A_log,
                                   const float* dt_bias, int Hk, int Hv, int dk, int dv, float scale, float* q, float* k,
                                   float* v, float* g, float* beta) {
  const int64_t t = blockIdx.x, C = 2 * int64_t(Hk) * dk + int64_t(Hv) * dv;
  const float* row = qkv + t * C;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  for (int r = warp; r < 2 * Hk; r += nwarps) {  // r < Hk: q head r; else k head r - Hk
    const float* src = row + int64_t(r) * dk;
    float x[8], ss = 0.f;  // dk <= 256: 8 values per lane
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = lane + 32 * e;
      x[e] = i < dk ? src[i] : 0.f;
      ss += x[e] * x[e];
    }
    ss = warp_sum(ss);
    const float s = rsqrtf(ss + 1e-6f) * (r < Hk ? scale : 1.f);
    float* dst = r < Hk ? q + (t * Hk + r) * dk : k + (t * Hk + r - Hk) * dk;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = lane + 32 * e;
      if (i < dk) dst[i] = x[e] * s;
    }
  }
  const float* vs = row + 2 * int64_t(Hk) * dk;
  for (int i = threadIdx.x; i < Hv * dv; i += blockDim.x) v[t * Hv * dv + i] = vs[i];
  for (int h = threadIdx.x; h < Hv; h += blockDim.x) {
    const int64_t i = t * Hv + h;
    beta[i] = 1.f / (1.f + expf(-b[i]));
    const float x = a[i] + dt_bias[h];
    const float sp = x > 20.f ? x : log1pf(expf(x));  // softplus (torch's threshold 20)
    g[i] = -expf(A_log[h]) * sp;
  }
}

/// Chunk list entry: first row and length of one chunk, and its sequence.
struct Chunk {
  int32_t start, len, seq;
};

/// One block per (chunk, value head): A, T = (I + A)^-1, w, u (fp32 [T, Hv, dk] / [T, Hv, dv]),
/// P (fp32 [chunks, Hv, 64, 64]) and the in-chunk cumulative gates G (fp32 [T, Hv]).
__global__ void __launch_bounds__(kThreads) chunk_prepare_kernel(const float* q, const float* k, const float* v,
                                                                 const float* g, const float* beta,
                                                                 const Chunk* chunks, int Hk, int Hv, int dk, int dv,
                                                                 float* w_out, float* u_out, float* P_out,
                                                                 float* G_out) {
  extern __shared__ float sm[];
  const int dmax = max(dk, dv), ld = dmax + 1;
  float* Ks = sm;                    // [64][ld] keys
  float* Xs = Ks + kChunk * ld;      // [64][ld] queries, later values
  float* M = Xs + kChunk * ld;       // [64][65] A, then T
  float* G = M + kChunk * (kChunk + 1);
  float* Bt = G + kChunk;
  const Chunk ch = chunks[blockIdx.x];
  const int h = blockIdx.y, kh = h / (Hv / Hk), L = ch.len, tid = threadIdx.x;
  for (int i = tid; i < kChunk * dk; i += kThreads) {
    const int r = i / dk, c = i % dk;
    const int64_t src = (int64_t(ch.start + r) * Hk + kh) * dk + c;
    Ks[r * ld + c] = r < L ? k[src] : 0.f;
    Xs[r * ld + c] = r < L ? q[src] : 0.f;
  }
  if (tid < kChunk) {
    G[tid] = tid < L ? g[int64_t(ch.start + tid) * Hv + h] : 0.f;
    Bt[tid] = tid < L ? beta[int64_t(ch.start + tid) * Hv + h] : 0.f;
  }
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < kChunk; ++i) G[i] += G[i - 1];
  __syncthreads();
  float* P = P_out + (int64_t(blockIdx.x) * Hv + h) * kChunk * kChunk;
  for (int e = tid; e < kChunk * kChunk; e += kThreads) {
    const int i = e / kChunk, j = e % kChunk;
    float kk = 0.f, qk = 0.f;
    if (j <= i && i < L)
      for (int c = 0; c < dk; ++c) {
        kk += Ks[i * ld + c] * Ks[j * ld + c];
        qk += Xs[i * ld + c] * Ks[j * ld + c];
      }
    const float decay = j <= i && i < L ? __expf(G[i] - G[j]) : 0.f;
    M[i * (kChunk + 1) + j] = j < i ? Bt[i] * decay * kk : 0.f;
    P[e] = decay * qk;
  }
  __syncthreads();
  // T = (I + A)^-1, row by row: T_ij = -sum_{m=j}^{i-1} A_im T_mj (j < i), T_ii = 1.
  for (int i = 1; i < L; ++i) {
    float t = 0.f;
    if (tid < i) {
      const int j = tid;
      t = -M[i * (kChunk + 1) + j];  // m = j: T_jj = 1
      for (int m = j + 1; m < i; ++m) t -= M[i * (kChunk + 1) + m] * M[m * (kChunk + 1) + j];
    }
    __syncthreads();
    if (tid < i) M[i * (kChunk + 1) + tid] = t;
    __syncthreads();
  }
  if (tid < kChunk) M[tid * (kChunk + 1) + tid] = 1.f;
  __syncthreads();
  // w = T diag(beta exp(G)) K
  for (int e = tid; e < L * dk; e += kThreads) {
    const int i = e / dk, c = e % dk;
    float acc = 0.f;
    for (int j = 0; j <= i; ++j) acc += M[i * (kChunk + 1) + j] * Bt[j] * __expf(G[j]) * Ks[j * ld + c];
    w_out[(int64_t(ch.start + i) * Hv + h) * dk + c] = acc;
  }
  __syncthreads();  // Xs (queries) is free now: values
  for (int i = tid; i < kChunk * dv; i += kThreads) {
    const int r = i / dv, c = i % dv;
    Xs[r * ld + c] = r < L ? v[(int64_t(ch.start + r) * Hv + h) * dv + c] : 0.f;
  }
  __syncthreads();
  for (int e = tid; e < L * dv; e += kThreads) {
    const int i = e / dv, c = e % dv;
    float acc = 0.f;
    for (int j = 0; j <= i; ++j) acc += M[i * (kChunk + 1) + j] * Bt[j] * Xs[j * ld + c];
    u_out[(int64_t(ch.start + i) * Hv + h) * dv + c] = acc;
  }
  if (tid < L) G_out[int64_t(ch.start + tid) * Hv + h] = G[tid];
}

/// One block per (sequence, value head, 32 state columns): walks the sequence's chunks in order.
__global__ void __launch_bounds__(kThreads) chunk_scan_kernel(const float* q, const float* k, const float* w_in,
                                                              const float* u_in, const float* P_in, const float* G_in,
                                                              const Chunk* chunks, const int32_t* first_chunk,
                                                              int Hk, int Hv, int dk, int dv, const float* init,
                                                              float* final_state, float* o) {
  extern __shared__ float sm[];
  const int ld = dk + 1;
  float* S = sm;                    // [dk][kCols] state columns c0 .. c0 + 31
  float* X = S + dk * kCols;        // [64][ld] w rows, then q rows, then k rows
  float* Pc = X + kChunk * ld;      // [64][65]
  float* U = Pc + kChunk * (kChunk + 1);  // [64][kCols + 1]
  float* G = U + kChunk * (kCols + 1);
  const int seq = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * kCols, kh = h / (Hv / Hk), tid = threadIdx.x;
  const int lane = tid % kCols, grp = tid / kCols, ngrp = kThreads / kCols;  // column, row group
  const bool col_ok = c0 + lane < dv;
  const int64_t state_off = (int64_t(seq) * Hv + h) * dk * dv;
  for (int e = tid; e < dk * kCols; e += kThreads) {
    const int m = e / kCols, c = e % kCols;
    S[e] = init && c0 + c < dv ? init[state_off + int64_t(m) * dv + c0 + c] : 0.f;
  }
  for (int ci = first_chunk[seq]; ci < first_chunk[seq + 1]; ++ci) {
    const Chunk ch = chunks[ci];
    const int L = ch.len;
    // w rows, u_hat columns, P, G
    for (int e = tid; e < L * dk; e += kThreads) {
      const int r = e / dk, c = e % dk;
      X[r * ld + c] = w_in[(int64_t(ch.start + r) * Hv + h) * dk + c];
    }
    for (int e = tid; e < L * kCols; e += kThreads) {
      const int r = e / kCols, c = e % kCols;
      U[r * (kCols + 1) + c] = c0 + c < dv ? u_in[(int64_t(ch.start + r) * Hv + h) * dv + c0 + c] : 0.f;
    }
    const float* P = P_in + (int64_t(ci) * Hv + h) * kChunk * kChunk;
    for (int e = tid; e < L * kChunk; e += kThreads) Pc[(e / kChunk) * (kChunk + 1) + e % kChunk] = P[e];
    if (tid < L) G[tid] = G_in[int64_t(ch.start + tid) * Hv + h];
    __syncthreads();
    // U = u_hat - w S0
    for (int i = grp; i < L; i += ngrp) {
      float acc = 0.f;
      for (int m = 0; m < dk; ++m) acc += X[i * ld + m] * S[m * kCols + lane];
      U[i * (kCols + 1) + lane] -= acc;
    }
    __syncthreads();
    for (int e = tid; e < L * dk; e += kThreads) {  // queries
      const int r = e / dk, c = e % dk;
      X[r * ld + c] = q[(int64_t(ch.start + r) * Hk + kh) * dk + c];
    }
    __syncthreads();
    // O = diag(exp(G)) Q S0 + P U
    for (int i = grp; i < L; i += ngrp) {
      float qs = 0.f, pu = 0.f;
      for (int m = 0; m < dk; ++m) qs += X[i * ld + m] * S[m * kCols + lane];
      for (int j = 0; j <= i; ++j) pu += Pc[i * (kChunk + 1) + j] * U[j * (kCols + 1) + lane];
      if (col_ok) o[(int64_t(ch.start + i) * Hv + h) * dv + c0 + lane] = __expf(G[i]) * qs + pu;
    }
    __syncthreads();
    for (int e = tid; e < L * dk; e += kThreads) {  // keys
      const int r = e / dk, c = e % dk;
      X[r * ld + c] = k[(int64_t(ch.start + r) * Hk + kh) * dk + c];
    }
    __syncthreads();
    // S = exp(G_L) S0 + (diag(exp(G_L - G)) K)^T U
    const float gl = G[L - 1];
    for (int m = grp; m < dk; m += ngrp) {
      float acc = __expf(gl) * S[m * kCols + lane];
      for (int j = 0; j < L; ++j) acc += __expf(gl - G[j]) * X[j * ld + m] * U[j * (kCols + 1) + lane];
      S[m * kCols + lane] = acc;
    }
    __syncthreads();
  }
  if (final_state)
    for (int e = tid; e < dk * kCols; e += kThreads) {
      const int m = e / kCols, c = e % kCols;
      if (c0 + c < dv) final_state[state_off + int64_t(m) * dv + c0 + c] = S[e];
    }
}

/// A warp per row.
__global__ void gated_rms_norm_kernel(const float* x, const float* z, const float* w, bf16* y, int64_t rows, int n,
                                      float eps) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float* xr = x + r * n;
  float ss = 0.f;
  for (int i = lane; i < n; i += 32) ss += xr[i] * xr[i];
  const float s = rsqrtf(warp_sum(ss) / float(n) + eps);
  for (int i = lane; i < n; i += 32) y[r * n + i] = __float2bfloat16_rn(w[i] * (xr[i] * s) * silu(z[r * n + i]));
}

}  // namespace

std::vector<int32_t> sequence_starts(const std::vector<int64_t>& cu) {
  std::vector<int32_t> r(cu.empty() ? 0 : size_t(cu.back()));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) r[size_t(t)] = int32_t(cu[s]);
  return r;
}

void causal_conv1d_silu(const float* x, const float* w, const int32_t* row_start, int64_t T, int64_t C, int K, float* y,
                        cudaStream_t stream) {
  if (K < 1 || K > 8 || C <= 0 || T < 0)
    throw std::invalid_argument("causal_conv1d_silu: kernel size " + std::to_string(K) + " (1..8), channels " +
                                std::to_string(C));
  if (T == 0) return;
  conv1d_silu_kernel<<<grid_for(T * C), 256, 0, stream>>>(x, w, row_start, T, C, K, y);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void gdn_prepare(const float* qkv, const float* b, const float* a, const float* A_log, const float* dt_bias, int64_t T,
                 int Hk, int Hv, int dk, int dv, float scale, float* q, float* k, float* v, float* g, float* beta,
                 cudaStream_t stream) {
  if (Hk <= 0 || Hv % Hk != 0 || dk <= 0 || dk > 256 || dv <= 0)
    throw std::invalid_argument("gdn_prepare: Hk " + std::to_string(Hk) + ", Hv " + std::to_string(Hv) + ", dk " +
                                std::to_string(dk) + " (<= 256), dv " + std::to_string(dv));
  if (T == 0) return;
  gdn_prepare_kernel<<<unsigned(T), 256, 0, stream>>>(qkv, b, a, A_log, dt_bias, Hk, Hv, dk, dv, scale, q, k, v, g, beta);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void gated_delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                              const std::vector<int64_t>& cu, int Hk, int Hv, int dk, int dv, const float* init,
                              float* final_state, float* o, cudaStream_t stream) {
  if (Hk <= 0 || Hv % Hk != 0 || dk <= 0 || dk > 128 || dv <= 0 || dv > 128 || cu.size() < 2 || cu.front() != 0)
    throw std::invalid_argument("gated_delta_rule_chunked: Hk " + std::to_string(Hk) + ", Hv " + std::to_string(Hv) +
                                ", dk " + std::to_string(dk) + ", dv " + std::to_string(dv) +
                                " (head dims <= 128), " + std::to_string(cu.size()) + " cu_seqlens entries");
  const int nseq = int(cu.size()) - 1;
  const int64_t T = cu.back();
  std::vector<Chunk> chunks;
  std::vector<int32_t> first{0};
  for (int s = 0; s < nseq; ++s) {
    if (cu[size_t(s) + 1] < cu[size_t(s)]) throw std::invalid_argument("gated_delta_rule_chunked: cu_seqlens decrease");
    for (int64_t t = cu[size_t(s)]; t < cu[size_t(s) + 1]; t += kChunk)
      chunks.push_back({int32_t(t), int32_t(std::min<int64_t>(kChunk, cu[size_t(s) + 1] - t)), s});
    first.push_back(int32_t(chunks.size()));
  }
  const int64_t nch = int64_t(chunks.size());
  // Empty sequences still pass their initial state through (chunk_scan runs no chunk for them).
  StreamBuffer<Chunk> d_chunks(size_t(nch), stream);
  if (nch)
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(d_chunks.data(), chunks.data(), size_t(nch) * sizeof(Chunk), cudaMemcpyHostToDevice,
                                      stream));
  auto d_first = upload(first, stream);
  StreamBuffer<float> w(size_t(T * Hv * dk), stream), u(size_t(T * Hv * dv), stream),
      P(size_t(nch * Hv * kChunk * kChunk), stream), G(size_t(T * Hv), stream);
  if (nch) {
    const size_t smem = (2 * kChunk * (std::max(dk, dv) + 1) + kChunk * (kChunk + 1) + 2 * kChunk) * sizeof(float);
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(chunk_prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    chunk_prepare_kernel<<<dim3(unsigned(nch), unsigned(Hv)), kThreads, smem, stream>>>(
        q, k, v, g, beta, d_chunks.data(), Hk, Hv, dk, dv, w.data(), u.data(), P.data(), G.data());
    DFLASH_CUDA_CHECK_LAUNCH();
  }
  const size_t smem = (dk * kCols + kChunk * (dk + 1) + kChunk * (kChunk + 1) + kChunk * (kCols + 1) + kChunk) *
                      sizeof(float);
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(chunk_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  chunk_scan_kernel<<<dim3(unsigned(nseq), unsigned(Hv), unsigned((dv + kCols - 1) / kCols)), kThreads, smem, stream>>>(
      q, k, w.data(), u.data(), P.data(), G.data(), d_chunks.data(), d_first.data(), Hk, Hv, dk, dv, init, final_state,
      o);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void gated_rms_norm(const float* x, const float* z, const float* w, bf16* y, int64_t rows, int64_t n, double eps,
                    cudaStream_t stream) {
  if (n <= 0 || rows < 0) throw std::invalid_argument("gated_rms_norm: rows " + std::to_string(rows) + ", n " + std::to_string(n));
  if (rows == 0) return;
  gated_rms_norm_kernel<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(x, z, w, y, rows, int(n), float(eps));
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
