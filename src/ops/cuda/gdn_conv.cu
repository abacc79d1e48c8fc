// The recurrence's per-token inputs on the GPU (gated_delta_rule.h): the causal depthwise conv1d +
// SiLU over packed sequences (with the query / key l2norm fused or by a second kernel: ConvQkNorm),
// gdn_prepare (q / k l2norm, v, the gates) and sequence_starts. References:
// cpu::causal_conv1d_silu (src/ops/cpu/gated_delta_rule.cpp), cpu::l2_norm (src/ops/cpu/norm.cpp).
#include <stdexcept>
#include <string>

#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/gdn_common.cuh"

namespace dflash::cuda {

namespace {

using namespace detail;

constexpr int kConvRun = 16;  // tokens per thread in the conv: each input is read from memory once

/// V = 1 or 4 consecutive bf16 as floats (V = 4: one 8-byte load, vec.cuh's load4).
template <int V>
__device__ __forceinline__ void load_bf16(const bf16* p, float (&out)[V]) {
  static_assert(V == 1 || V == 4, "one channel or four");
  if constexpr (V == 4)
    load4(p, out);
  else
    out[0] = __bfloat162float(*p);
}

/// A thread per (V channels, run of kConvRun tokens): the last K inputs of its channels slide through
/// registers. Rows before row_start[t] count as zero (the same sum, term by term, as the CPU
/// reference). V = 4 needs C and x_stride multiples of 4, x 8-byte and y 16-byte aligned. kNorm (V =
/// 4, qk.dk / 4 a power of two <= 32: a head is an aligned group of lanes, every lane of the warp
/// taking part in the sums): the query / key heads' outputs l2-normalized to qk.q / qk.k instead of y.
template <int K, int V, bool kNorm>
__global__ void conv1d_silu_kernel(const bf16* __restrict__ x, int64_t x_stride, const float* __restrict__ w,
                                   const int32_t* __restrict__ row_start, int64_t T, int64_t C, float* __restrict__ y,
                                   ConvQkNorm qk) {
  static_assert(!kNorm || V == 4, "the fused l2norm takes four channels per lane");
  const int64_t c = (blockIdx.y * int64_t(blockDim.x) + threadIdx.x) * V, t0 = int64_t(blockIdx.x) * kConvRun;
  const bool live = c < C;
  if (!kNorm && !live) return;  // (kNorm: every lane stays for the sums)
  const int64_t q_ch = int64_t(qk.Hk) * qk.dk;
  float wk[V][K], win[K][V];  // at token t: win[j] = x[t - K + 1 + j, c ..]; before the first, x[t0 - K + j, c ..]
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) wk[v][j] = live ? w[(c + v) * K + j] : 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int64_t src = t0 - K + j;
    if (src >= 0 && live) {
      load_bf16<V>(x + src * x_stride + c, win[j]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) win[j][v] = 0.f;
    }
  }
  const int64_t t_end = t0 + kConvRun < T ? t0 + kConvRun : T;
  for (int64_t t = t0; t < t_end; ++t) {
#pragma unroll
    for (int j = 0; j + 1 < K; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) win[j][v] = win[j + 1][v];
    if (live) load_bf16<V>(x + t * x_stride + c, win[K - 1]);
    const int64_t b = row_start[t];
    float out[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (t - K + 1 + j >= b) acc += wk[v][j] * win[j][v];
      out[v] = fast_silu(acc);
    }
    if constexpr (kNorm) {  // every lane takes part in the head's sums (a head's lanes are aligned)
      const bool is_q = c < q_ch;
      float nrm[4] = {out[0], out[1], out[2], out[3]};
      l2norm_lanes(nrm, qk.dk / 4, is_q ? qk.q_scale : 1.f);
      if (c < 2 * q_ch) {
        float* dst = is_q ? qk.q + t * q_ch + c : qk.k + t * q_ch + (c - q_ch);
        *reinterpret_cast<float4*>(dst) = make_float4(nrm[0], nrm[1], nrm[2], nrm[3]);
        continue;
      }
      if (!live) continue;
    }
    if constexpr (V == 4) {
      *reinterpret_cast<float4*>(y + t * C + c) = make_float4(out[0], out[1], out[2], out[3]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) y[t * C + c + v] = out[v];
    }
  }
}

/// Token t's query and key heads of row (q | k ..., fp32), a warp per head of the block:
/// q = scale l2norm, k = l2norm into q / k [T, Hk, dk] (dk <= 256).
__device__ __forceinline__ void l2norm_heads(const float* row, int64_t t, int Hk, int dk, float scale, float* q,
                                             float* k) {
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
}

/// One block per token of a [T, C] conv output: l2norm_heads (the unfused ConvQkNorm).
__global__ void qk_l2norm_kernel(const float* y, int64_t C, ConvQkNorm qk) {
  l2norm_heads(y + blockIdx.x * C, blockIdx.x, qk.Hk, qk.dk, qk.q_scale, qk.q, qk.k);
}

/// One block per token: the q / k heads (l2norm_heads, unless q is null), then v and the gates.
__global__ void gdn_prepare_kernel(const float* qkv, const bf16* b, const bf16* a, int64_t ba_stride,
                                   const float* A_log, const float* dt_bias, int Hk, int Hv, int dk, int dv,
                                   float scale, float* q, float* k, float* v, float* g, float* beta) {
  const int64_t t = blockIdx.x, C = 2 * int64_t(Hk) * dk + int64_t(Hv) * dv;
  const float* row = qkv + t * C;
  if (q) l2norm_heads(row, t, Hk, dk, scale, q, k);
  const float* vs = row + 2 * int64_t(Hk) * dk;
  if (v)
    for (int i = threadIdx.x; i < Hv * dv; i += blockDim.x) v[t * Hv * dv + i] = vs[i];
  for (int h = threadIdx.x; h < Hv; h += blockDim.x) {
    const int64_t i = t * Hv + h, j = t * ba_stride + h;
    gates(b[j], a[j], A_log[h], dt_bias[h], g[i], beta[i]);
  }
}

}  // namespace

std::vector<int32_t> sequence_starts(const std::vector<int64_t>& cu) {
  if (!cu.empty() && cu.back() > INT32_MAX)
    throw std::invalid_argument("sequence_starts: " + std::to_string(cu.back()) + " rows do not fit int32");
  std::vector<int32_t> r(cu.empty() ? 0 : size_t(cu.back()));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) r[size_t(t)] = int32_t(cu[s]);
  return r;
}

void causal_conv1d_silu(const bf16* x, int64_t x_stride, const float* w, const int32_t* row_start, int64_t T,
                        int64_t C, int K, float* y, cudaStream_t stream, const ConvQkNorm* qk) {
  if (K < 1 || K > 8 || C <= 0 || T < 0 || x_stride < C)
    throw std::invalid_argument("causal_conv1d_silu: kernel size " + std::to_string(K) + " (1..8), channels " +
                                std::to_string(C) + ", input row stride " + std::to_string(x_stride) +
                                " (>= channels)");
  if (qk && (qk->Hk <= 0 || qk->dk <= 0 || qk->dk > 256 || 2 * int64_t(qk->Hk) * qk->dk > C || !qk->q || !qk->k))
    throw std::invalid_argument("causal_conv1d_silu: query / key norm over " + std::to_string(qk->Hk) +
                                " heads of " + std::to_string(qk->dk) + " (dk <= 256; 2 Hk dk <= " +
                                std::to_string(C) + " channels; q and k given)");
  if (T == 0) return;
  // Four channels per thread (8-byte loads, 16-byte stores) where the layout allows; the l2norm in the
  // same kernel where a head is an aligned group of lanes.
  const bool vec4 = C % 4 == 0 && x_stride % 4 == 0 && aligned_to(8, x) && aligned_to(16, y);
  const bool fused = qk && vec4 && qk->dk % 4 == 0 && qk->dk <= 128 && (qk->dk & (qk->dk - 1)) == 0 &&
                     aligned_to(16, qk->q, qk->k);
  const int64_t per_block = vec4 ? 1024 : 256;
  if ((C + per_block - 1) / per_block > 65535)
    throw std::invalid_argument("causal_conv1d_silu: " + std::to_string(C) + " channels");
  const dim3 grid(unsigned((T + kConvRun - 1) / kConvRun), unsigned((C + per_block - 1) / per_block));
  const ConvQkNorm norm = fused ? *qk : ConvQkNorm{};
  auto launch = [&](auto kernel) { kernel<<<grid, 256, 0, stream>>>(x, x_stride, w, row_start, T, C, y, norm); };
  switch (K) {
#define DFLASH_CONV_CASE(k)                    \
  case k:                                      \
    if (fused)                                 \
      launch(conv1d_silu_kernel<k, 4, true>);  \
    else if (vec4)                             \
      launch(conv1d_silu_kernel<k, 4, false>); \
    else                                       \
      launch(conv1d_silu_kernel<k, 1, false>); \
    break;
    DFLASH_CONV_CASE(1) DFLASH_CONV_CASE(2) DFLASH_CONV_CASE(3) DFLASH_CONV_CASE(4)
    DFLASH_CONV_CASE(5) DFLASH_CONV_CASE(6) DFLASH_CONV_CASE(7) DFLASH_CONV_CASE(8)
#undef DFLASH_CONV_CASE
  }
  DFLASH_CUDA_CHECK_LAUNCH();
  if (qk && !fused) {
    qk_l2norm_kernel<<<unsigned(T), 256, 0, stream>>>(y, C, *qk);
    DFLASH_CUDA_CHECK_LAUNCH();
  }
}

void gdn_prepare(const float* qkv, const bf16* b, const bf16* a, int64_t ba_stride, const float* A_log,
                 const float* dt_bias, int64_t T, int Hk, int Hv, int dk, int dv, float scale, float* q, float* k,
                 float* v, float* g, float* beta, cudaStream_t stream) {
  if (Hk <= 0 || Hv % Hk != 0 || dk <= 0 || dk > 256 || dv <= 0 || ba_stride < Hv)
    throw std::invalid_argument("gdn_prepare: Hk " + std::to_string(Hk) + ", Hv " + std::to_string(Hv) + ", dk " +
                                std::to_string(dk) + " (<= 256), dv " + std::to_string(dv) + ", b / a row stride " +
                                std::to_string(ba_stride) + " (>= Hv)");
  if (!q != !k)
    throw std::invalid_argument("gdn_prepare: q and k are written together (both given or both null)");
  if (T == 0) return;
  gdn_prepare_kernel<<<unsigned(T), 256, 0, stream>>>(qkv, b, a, ba_stride, A_log, dt_bias, Hk, Hv, dk, dv, scale, q, k,
                                                      v, g, beta);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
