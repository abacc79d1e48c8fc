// Device helpers of the masked attention backward, shared by its mma.sync (attention_bwd_mma.cu) and
// warpgroup-MMA (attention_bwd_wgmma.cu) kernels: the dQ kernels' probabilities and epilogue, the
// dK / dV kernels' work items, probabilities, epilogue and item loop.
#pragma once
#include "gpu/wgmma.cuh"
#include "ops/cuda/attention_common.cuh"

namespace dflash::cuda::detail {

using namespace mma;

/// The dQ kernels' epilogue: rows ra and rb (< Nq) of head h get acc scale (bf16).
template <int D>
__device__ __forceinline__ void write_dq_rows(const float (*acc)[4], float scale, bf16* dq, int ra, int rb, int Nq,
                                              int H, int h, int t) {
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int c = dt * 8 + 2 * t;
    if (ra < Nq)
      *reinterpret_cast<uint32_t*>(dq + (int64_t(ra) * H + h) * D + c) = pack(acc[dt][0] * scale, acc[dt][1] * scale);
    if (rb < Nq)
      *reinterpret_cast<uint32_t*>(dq + (int64_t(rb) * H + h) * D + c) = pack(acc[dt][2] * scale, acc[dt][3] * scale);
  }
}

/// s [16 x N] of the warp's rows ra / rb (one m-tile): S -> P = exp2(S scale_log2 - lse2) in place;
/// a tile not `full` masks by the rows' ranges (rga / rgb) through range `seg`.
template <int N>
__device__ __forceinline__ void dq_probs(float (*s)[4], bool full, const KvRange32& rga, const KvRange32& rgb,
                                         float lse_a, float lse_b, int k0, int seg, int Nk, int t, float scale_log2) {
  if (full) {  // (one uniform branch, then no per-element test)
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -(e < 2 ? lse_a : lse_b)));
    return;
  }
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = k0 + nt * 8 + 2 * t + (e & 1);
      const bool ok = key < Nk && visible_in(e < 2 ? rga : rgb, key, seg);
      s[nt][e] = ok ? fast_exp2(fmaf(s[nt][e], scale_log2, -(e < 2 ? lse_a : lse_b))) : 0.f;
    }
}

/// p: P -> dS = P (dP - delta) in place (delta per row: dl_a for rows g, dl_b for rows g + 8).
template <int N>
__device__ __forceinline__ void dq_dscores(float (*p)[4], const float (*dp)[4], float dl_a, float dl_b) {
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) p[nt][e] *= dp[nt][e] - (e < 2 ? dl_a : dl_b);
}

/// The dK / dV kernels' work items for the key tile [k0, k0 + kr): (query tile qt, query head hi of
/// the kv head, hi < G), over the query tiles [.., qt_end) whose ranges reach the key tile (tiles:
/// the tile table of tile_union_kernel). qt < 0: no item left. A key tile is mostly seen by a run of
/// consecutive query tiles: the union of the tile after the current one is loaded G items ahead of
/// its test, and first_hit searches only at the start and after a gap.
struct DkvItems {
  const int4* tiles;
  int k0, kr, qt_end, G;
  int qt = -1, hi = 0;
  int4 cand;
  __device__ DkvItems(const int4* tiles, int k0, int kr, int qt_begin, int qt_end, int G)
      : tiles(tiles), k0(k0), kr(kr), qt_end(qt_end), G(G) {
    qt = first_hit(qt_begin);
    cand = union_after(qt);
  }
  __device__ bool hits_union(int4 u) const {
    return (u.x < u.y && u.x < k0 + kr && k0 < u.y) || (u.z < u.w && u.z < k0 + kr && k0 < u.w);
  }
  /// The first query tile from `from` on that reaches the key tile; each warp tests 32 tiles at a
  /// time (a key tile of the blocks is reached by one query tile, far into the table).
  __device__ int first_hit(int from) const {
    const int lane = threadIdx.x % 32;
    for (int base = from; base < qt_end; base += 32) {
      const int qi = base + lane;
      const unsigned m = __ballot_sync(0xffffffffu, qi < qt_end && hits_union(tiles[2 * qi]));
      if (m) return base + __ffs(int(m)) - 1;
    }
    return -1;
  }
  __device__ int4 union_after(int qi) const {
    return qi >= 0 && qi + 1 < qt_end ? tiles[2 * (qi + 1)] : make_int4(0, 0, 0, 0);
  }
  /// The item after the current one (nqt < 0: none); advances the look-ahead, not the current item.
  __device__ void peek_next(int& nqt, int& nhi) {
    nqt = qt, nhi = hi + 1;
    if (nhi == G) {
      nqt = qt + 1 < qt_end && hits_union(cand) ? qt + 1 : first_hit(qt + 2), nhi = 0;
      cand = union_after(nqt);
    }
  }
  /// Whether every row of the current query tile sees all keys [k0, k0 + kr) (its intersection).
  __device__ bool full(int Nk) const {
    const int4 in = tiles[2 * qt + 1];
    return (k0 >= in.x && k0 + kr <= in.y && k0 + kr <= Nk) || (k0 >= in.z && k0 + kr <= in.w && k0 + kr <= Nk);
  }
};

/// Queues (cp.async, no commit) the statistics of query tile row0 of head h into shared memory: the
/// rows' lse2_t and delta_t (head-major, padded to Nqp: 16 bytes a copy) and ranges (rows past Nq:
/// an empty range), so no thread waits on a global load before an item's math. Threads 0..BM-1.
__device__ __forceinline__ void copy_row_stats(float* s_lse, float* s_delta, KvRange32* s_rg, const float* lse2_t,
                                               const float* delta_t, const KvRange32* ranges, int h, int row0, int Nq,
                                               int Nqp) {
  static_assert(BM == 64, "one statistics copy per thread");
  const int i = threadIdx.x;
  if (i < BM / 4) cp_async16(&s_lse[4 * i], lse2_t + int64_t(h) * Nqp + row0 + 4 * i, true);
  else if (i < BM / 2) cp_async16(&s_delta[4 * (i - BM / 4)], delta_t + int64_t(h) * Nqp + row0 + 4 * (i - BM / 4), true);
  if (i < BM) cp_async16(&s_rg[i], row0 + i < Nq ? ranges + row0 + i : ranges, row0 + i < Nq);
}

/// st [keys x 64 queries]: S^T -> P^T in place (accumulator layout: rows = keys key_a / key_b,
/// columns = the query tile's rows); a tile not `full` masks by the rows' ranges.
template <int NT>
__device__ __forceinline__ void dkv_probs(float (*st)[4], bool full, const float* s_lse, const KvRange32* s_rg,
                                          int row0, int Nq, int Nk, int key_a, int key_b, int t, float scale_log2) {
  if (full) {  // (one uniform branch, then no per-element test)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = fast_exp2(fmaf(st[nt][e], scale_log2, -s_lse[nt * 8 + 2 * t + (e & 1)]));
    return;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ql = nt * 8 + 2 * t + (e & 1), key = e < 2 ? key_a : key_b;
      const bool ok = row0 + ql < Nq && key < Nk && visible(s_rg[ql], key);
      st[nt][e] = ok ? fast_exp2(fmaf(st[nt][e], scale_log2, -s_lse[ql])) : 0.f;
    }
}

/// dpt: dP^T -> dS^T = P^T (dP^T - delta) in place (pt = P^T; delta per column, the query rows).
template <int NT>
__device__ __forceinline__ void dkv_dscores(float (*dpt)[4], const float (*pt)[4], const float* s_delta, int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dpt[nt][e] = pt[nt][e] * (dpt[nt][e] - s_delta[nt * 8 + 2 * t + (e & 1)]);
}

/// The dK / dV kernels' epilogue for keys key_a / key_b (< Nk) of kv head kvh: dK (times scale) and
/// dV as bf16, or as fp32 partial sums of part `part` when part_dk / part_dv are non-null.
template <int D>
__device__ __forceinline__ void write_dkv_rows(const float (*dka)[4], const float (*dva)[4], float scale, int key_a,
                                               int key_b, int Nk, int Hkv, int kvh, int part, int t, bf16* dk, bf16* dv,
                                               float* part_dk, float* part_dv) {
  const int64_t off = part_dk ? int64_t(part) * Nk * Hkv * D : 0;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int c = dt * 8 + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = half ? key_b : key_a;
      if (key >= Nk) continue;
      const int64_t i = (int64_t(key) * Hkv + kvh) * D + c;
      const float k0 = dka[dt][2 * half] * scale, k1 = dka[dt][2 * half + 1] * scale;
      const float v0 = dva[dt][2 * half], v1 = dva[dt][2 * half + 1];
      if (part_dk) {
        *reinterpret_cast<float2*>(part_dk + off + i) = make_float2(k0, k1);
        *reinterpret_cast<float2*>(part_dv + off + i) = make_float2(v0, v1);
      } else {
        *reinterpret_cast<uint32_t*>(dk + i) = pack(k0, k1);
        *reinterpret_cast<uint32_t*>(dv + i) = pack(v0, v1);
      }
    }
  }
}

/// The dK / dV kernels' loop over their work items, kBufs buffers: the copies of the item after the
/// current one (issue(qt, hi, buffer): one cp.async group, and TMA copies that landed(item index)
/// waits for) are queued before the current one is waited for, then a barrier, then
/// compute(qt, buffer, full). With two buffers a second barrier
/// follows (every warp is done with the buffer before it is refilled); with three the buffer refilled
/// at item i was last read by item i - 2, which every warp finished before the barrier of item i - 1.
/// kAsyncProxy: the CTA's K / V (cp.async, landing with the first item) are read by wgmma, which needs
/// a proxy fence after the copies land (the TMA's tiles need none).
template <bool kAsyncProxy, int kBufs, typename Issue, typename Landed, typename Compute>
__device__ __forceinline__ void for_each_item(DkvItems& items, int Nk, Issue& issue, Landed&& landed, Compute&& compute) {
  static_assert(kBufs == 2 || kBufs == 3, "two or three buffers");
  int buf = 0, index = 0;
  if (items.qt >= 0) issue(items.qt, 0, 0);
  cp_async_commit();
  while (items.qt >= 0) {
    int nqt, nhi;
    items.peek_next(nqt, nhi);
    const int nbuf = buf + 1 == kBufs ? 0 : buf + 1;
    if (nqt >= 0) issue(nqt, nhi, nbuf);
    cp_async_commit();
    const bool full = items.full(Nk);
    cp_async_wait_prev();
    landed(index++);
    if constexpr (kAsyncProxy) wgmma::fence_proxy_async();
    __syncthreads();
    compute(items.qt, buf, full);
    if constexpr (kBufs == 2) __syncthreads();
    items.qt = nqt, items.hi = nhi;
    buf = nbuf;
  }
}

}  // namespace dflash::cuda::detail
