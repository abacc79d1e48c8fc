// The forward's online softmax and epilogue, shared by its mma.sync (attention_fwd_mma.cu) and
// warpgroup-MMA (attention_fwd_wgmma.cu) kernels.
#pragma once
#include "ops/cuda/attention_common.cuh"

namespace dflash::cuda::detail {

using namespace mma;

/// Running softmax state of one 16-row m-tile: the thread's rows g and g + 8.
template <int D>
struct RowTile {
  float oacc[D / 8][4];
  float m_a, m_b, l_a, l_b;
};

/// How far (log2 units) a row's scores may exceed its running max before the max moves.
constexpr float kMaxSlack = 8.f;

/// The factors online_softmax_scores leaves for O: rows g and g + 8 times a and b, none when `stay`.
struct Rescale {
  float a, b;
  bool stay;
};

/// The online softmax of one m-tile over a key tile: s [16 x N] raw scores -> probabilities (in
/// place), running max / sum (log2 domain, scaled) updated; returns O's factors (rescale_o). Rows
/// ra / rb; a tile not `full` masks by their ranges. scale_log2 > 0, so the max of the raw scores
/// scales to the max of the scaled ones and each probability is one FFMA and one exp2.
/// kConditional: conditional rescaling (FlashAttention-4, Zadouri et al. 2025): while no score of the
/// warp's rows exceeds its row's running max by more than kMaxSlack, the max stays, the
/// probabilities are exp2(s - m) <= 2^kMaxSlack (O / l and the logsumexp are the same for any m) and
/// the warp skips rescaling O. On in the head_dim 256 forward, where that is 128 multiplies per thread
/// and tile (655 -> 632 us in the 27B target's attention); off elsewhere (the head_dim 128 forward,
/// whose softmax overlaps a product in flight, measured 1.09 -> 1.16 ms with it).
template <int D, int N, bool kConditional>
__device__ __forceinline__ Rescale online_softmax_scores(float (*s)[4], RowTile<D>& r, bool full, const KvRange32* ranges,
                                                         int ra, int rb, int Nq, int k0, int seg, int Nk, int t,
                                                         float scale_log2) {
  float mx_a = -INFINITY, mx_b = -INFINITY;
  if (!full) {
    const KvRange32 rga = ra < Nq ? ranges[ra] : KvRange32{}, rgb = rb < Nq ? ranges[rb] : KvRange32{};
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + nt * 8 + 2 * t + (e & 1);
        if (!(key < Nk && visible_in(e < 2 ? rga : rgb, key, seg))) s[nt][e] = -INFINITY;
      }
  }
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
    mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
    mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
  }
  const float tm_a = quad_max(mx_a) * scale_log2, tm_b = quad_max(mx_b) * scale_log2;
  // (false while a row saw nothing, m = -inf, and this tile shows it a key; fmaxf drops NaN scores
  // from the max, and their exp2 makes l and O NaN on either path)
  const bool stay = kConditional && __all_sync(0xffffffffu, tm_a <= r.m_a + kMaxSlack && tm_b <= r.m_b + kMaxSlack);
  const float mn_a = stay ? r.m_a : fmaxf(r.m_a, tm_a), mn_b = stay ? r.m_b : fmaxf(r.m_b, tm_b);
  const float base_a = mn_a == -INFINITY ? 0.f : mn_a, base_b = mn_b == -INFINITY ? 0.f : mn_b;
  float ps_a = 0.f, ps_b = 0.f;
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
    s[nt][0] = fast_exp2(fmaf(s[nt][0], scale_log2, -base_a)), s[nt][1] = fast_exp2(fmaf(s[nt][1], scale_log2, -base_a));
    s[nt][2] = fast_exp2(fmaf(s[nt][2], scale_log2, -base_b)), s[nt][3] = fast_exp2(fmaf(s[nt][3], scale_log2, -base_b));
    ps_a += s[nt][0] + s[nt][1];
    ps_b += s[nt][2] + s[nt][3];
  }
  if (stay) {
    r.l_a += ps_a, r.l_b += ps_b;
    return {1.f, 1.f, true};
  }
  const float al_a = fast_exp2(r.m_a - base_a), al_b = fast_exp2(r.m_b - base_b);  // 0 while nothing was seen
  r.l_a = r.l_a * al_a + ps_a;
  r.l_b = r.l_b * al_b + ps_b;
  r.m_a = mn_a, r.m_b = mn_b;
  return {al_a, al_b, false};
}

/// O's part of the online softmax (separate, so that a product still writing O can run meanwhile).
template <int D>
__device__ __forceinline__ void rescale_o(RowTile<D>& r, const Rescale& c) {
  if (c.stay) return;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) r.oacc[i][0] *= c.a, r.oacc[i][1] *= c.a, r.oacc[i][2] *= c.b, r.oacc[i][3] *= c.b;
}

/// online_softmax_scores (rescaling O on every tile), then rescale_o.
template <int D, int N>
__device__ __forceinline__ void online_softmax(float (*s)[4], RowTile<D>& r, bool full, const KvRange32* ranges, int ra,
                                               int rb, int Nq, int k0, int seg, int Nk, int t, float scale_log2) {
  rescale_o(r, online_softmax_scores<D, N, false>(s, r, full, ranges, ra, rb, Nq, k0, seg, Nk, t, scale_log2));
}

/// The forward's epilogue for one m-tile: rows ra and rb of head h get O / l (bf16; 0 for a row
/// that saw nothing) and, when lse is non-null, the natural-log logsumexp (-inf for such a row).
template <int D>
__device__ __forceinline__ void write_rows(RowTile<D>& r, bf16* o, float* lse, int ra, int rb, int Nq, int H, int h, int t) {
  r.l_a = quad_sum(r.l_a), r.l_b = quad_sum(r.l_b);
  const float ia = r.l_a > 0.f ? 1.f / r.l_a : 0.f, ib = r.l_b > 0.f ? 1.f / r.l_b : 0.f;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int c = dt * 8 + 2 * t;
    if (ra < Nq)
      *reinterpret_cast<uint32_t*>(o + (int64_t(ra) * H + h) * D + c) = pack(r.oacc[dt][0] * ia, r.oacc[dt][1] * ia);
    if (rb < Nq)
      *reinterpret_cast<uint32_t*>(o + (int64_t(rb) * H + h) * D + c) = pack(r.oacc[dt][2] * ib, r.oacc[dt][3] * ib);
  }
  if (lse && t == 0) {
    if (ra < Nq) lse[int64_t(ra) * H + h] = r.l_a > 0.f ? (r.m_a + log2f(r.l_a)) * kLn2 : -INFINITY;
    if (rb < Nq) lse[int64_t(rb) * H + h] = r.l_b > 0.f ? (r.m_b + log2f(r.l_b)) * kLn2 : -INFINITY;
  }
}

}  // namespace dflash::cuda::detail
