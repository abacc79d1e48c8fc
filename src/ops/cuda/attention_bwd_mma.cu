// The masked attention backward on mma.sync tensor cores (masked_attention.h), head_dim 64 and 128:
// dQ per query tile (dq_kernel), dK / dV per key tile over the query heads of its kv head
// (dkv_kernel), deterministic (no atomics).
#include <stdexcept>
#include <string>

#include "ops/cuda/attention_bwd_common.cuh"
#include "ops/cuda/attention_kernels.h"

namespace dflash::cuda::detail {

namespace {

// dQ: one CTA per (query tile, head), like the forward; recomputes P and dP per key tile.
template <int D, int W>
__global__ void __launch_bounds__(32 * W) dq_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                      const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                                      const float* __restrict__ lse2_t, const float* __restrict__ delta_t,
                                                      const KvRange32* __restrict__ ranges, int Nq, int Nqp, int Nk,
                                                      int H, int Hkv, float scale, bf16* dq) {
  constexpr int LD = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int QR = 16 * W;
  static_assert(BM % QR == 0, "a query tile's rows stay below Nqp, the rows of the statistics");
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [QR][LD]
  bf16* Os = Qs + QR * LD;                   // dO, [QR][LD]
  bf16* Kb = Os + QR * LD;                   // 2 x [BN][LD]
  bf16* Vb = Kb + 2 * BN * LD;               // 2 x [BN][LD]
  __shared__ int lohi[8];
  // Query tiles in reverse: later rows see more keys (causal, and DFlash anchors are sorted), so
  // the longest tiles start first and the short ones fill the end of the launch.
  const int h = blockIdx.y, kvh = h / (H / Hkv), row0 = (gridDim.x - 1 - blockIdx.x) * QR;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale_log2 = scale * kLog2e;
  // Q and dO are copied (one cp.async group) while the ranges are scanned and the first key tile
  // is queued; the rows' statistics load meanwhile.
  copy_rows_async<D, 32 * W, QR>(Qs, LD, q, Nq, H, h, row0);
  copy_rows_async<D, 32 * W, QR>(Os, LD, dout, Nq, H, h, row0);
  cp_async_commit();
  const int ra = row0 + warp * 16 + g, rb = ra + 8;
  const KvRange32 rga = ra < Nq ? ranges[ra] : KvRange32{}, rgb = rb < Nq ? ranges[rb] : KvRange32{};
  const int64_t hrow = int64_t(h) * Nqp;  // (ra, rb < Nqp)
  const float lse_a = lse2_t[hrow + ra], lse_b = lse2_t[hrow + rb], dl_a = delta_t[hrow + ra], dl_b = delta_t[hrow + rb];
  tile_union(ranges, Nq, row0, QR, lohi);  // (synchronizes)
  const KvPipeline<D, BN, 32 * W> kv(lohi, Kb, Vb, k, v, Nk, Hkv, kvh);
  kv.fetch(0);
  cp_async_wait<1>();  // Q and dO have landed (the key tile may still be in flight)
  __syncthreads();
  uint32_t qa[D / 16][4], da[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    load_a_x4(qa[kk], Qs, LD, warp * 16, kk * 16, lane);
    load_a_x4(da[kk], Os, LD, warp * 16, kk * 16, lane);
  }
  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int j = 0; j < kv.tiles.n; ++j) {
    const int seg = kv.tiles.seg(j), k0 = kv.tiles.start(j);
    const bf16* Ks = kv.K(j);
    const bf16* Vs = kv.V(j);
    kv.wait(j);
    {
      float s[BN / 8][4], dp[BN / 8][4];
      frag_times_smem_t<D, BN>(s, qa, Ks, LD, lane);   // S = Q K^T
      frag_times_smem_t<D, BN>(dp, da, Vs, LD, lane);  // dP = dO V^T
      dq_probs<BN>(s, tile_full(lohi, seg, k0, BN, Nk), rga, rgb, lse_a, lse_b, k0, seg, Nk, t, scale_log2);
      dq_dscores<BN>(s, dp, dl_a, dl_b);
      acc_times_smem<D, BN>(acc, s, Ks, LD, lane);
    }
    __syncthreads();
  }
  write_dq_rows<D>(acc, scale, dq, ra, rb, Nq, H, h, t);
}

// dK, dV: one CTA per (key tile, kv head, part); warp w owns keys 16w..16w+15; loops over the query
// heads of the kv head and the query tiles of its part (query tiles [part * qpp, (part + 1) * qpp))
// whose ranges reach the key tile. The linear block index runs key tiles slowest, so the early key
// tiles, which most queries see, start first. With one part dK / dV are written as bf16; with
// several, each part writes fp32 partial sums [part][Nk][Hkv][D] that dkv_reduce_kernel adds up in
// part order (deterministic) - the split keeps a heavily seen key tile from being one long serial
// chain at the end of the launch.
template <int D, int W>
__global__ void __launch_bounds__(32 * W) dkv_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                       const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                                       const float* __restrict__ lse2_t, const float* __restrict__ delta_t,
                                                       const KvRange32* __restrict__ ranges,
                                                       const int4* __restrict__ tiles, int Nq, int Nqp, int Nk, int H, int Hkv,
                                                       float scale, int qpp, bf16* dk, bf16* dv, float* part_dk,
                                                       float* part_dv) {
  constexpr int LD = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int KR = 16 * W;  // keys per CTA
  static_assert(32 * W >= BM, "copy_row_stats");
  bf16* Ks = reinterpret_cast<bf16*>(smem);  // [KR][LD]
  bf16* Vs = Ks + KR * LD;                   // [KR][LD]
  bf16* Qb = Vs + KR * LD;                   // 2 x [BM][LD]
  bf16* Ob = Qb + 2 * BM * LD;               // dO, 2 x [BM][LD]
  __shared__ __align__(16) float s_lse_b[2][BM], s_delta_b[2][BM];  // lse2_t, delta_t of the item's rows
  __shared__ __align__(16) KvRange32 s_rg_b[2][BM];
  const int kvh = blockIdx.x % Hkv, k0 = (blockIdx.x / Hkv) * KR, G = H / Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale_log2 = scale * kLog2e;
  // K and V of this key tile land with the first item's Q and dO (one cp.async group).
  copy_rows_async<D, 32 * W, KR>(Ks, LD, k, Nk, Hkv, kvh, k0);
  copy_rows_async<D, 32 * W, KR>(Vs, LD, v, Nk, Hkv, kvh, k0);
  const int key_a = k0 + warp * 16 + g, key_b = key_a + 8;
  float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[i][e] = dva[i][e] = 0.f;
  const int qt_begin = blockIdx.y * qpp;
  DkvItems items(tiles, k0, KR, qt_begin, min((Nq + BM - 1) / BM, qt_begin + qpp), G);
  auto issue = [&](int qt, int hi, int buf) {
    const int row0 = qt * BM, h = kvh * G + hi;
    copy_rows_async<D, 32 * W, BM>(Qb + buf * BM * LD, LD, q, Nq, H, h, row0);
    copy_rows_async<D, 32 * W, BM>(Ob + buf * BM * LD, LD, dout, Nq, H, h, row0);
    copy_row_stats(s_lse_b[buf], s_delta_b[buf], s_rg_b[buf], lse2_t, delta_t, ranges, h, row0, Nq, Nqp);
  };
  for_each_item<false, 2>(items, Nk, issue, [](int) {}, [&](int qt, int buf, bool full) {
    const bf16* Qs = Qb + buf * BM * LD;
    const bf16* Os = Ob + buf * BM * LD;
    float st[BM / 8][4], dpt[BM / 8][4];  // [keys of the warp] x [queries]
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      load_a_x4(ka, Ks, LD, warp * 16, kk * 16, lane);
      load_a_x4(va, Vs, LD, warp * 16, kk * 16, lane);
#pragma unroll
      for (int nt = 0; nt < BM / 8; nt += 2) {
        uint32_t b[4];
        load_b_x4(b, Qs, LD, nt * 8, kk * 16, lane);
        mma16816(st[nt], ka, b[0], b[1]);
        mma16816(st[nt + 1], ka, b[2], b[3]);
        load_b_x4(b, Os, LD, nt * 8, kk * 16, lane);
        mma16816(dpt[nt], va, b[0], b[1]);
        mma16816(dpt[nt + 1], va, b[2], b[3]);
      }
    }
    dkv_probs<BM / 8>(st, full, s_lse_b[buf], s_rg_b[buf], qt * BM, Nq, Nk, key_a, key_b, t, scale_log2);
    dkv_dscores<BM / 8>(dpt, st, s_delta_b[buf], t);
    acc_times_smem<D, BM>(dva, st, Os, LD, lane);   // dV += P^T dO
    acc_times_smem<D, BM>(dka, dpt, Qs, LD, lane);  // dK += dS^T Q (scaled at the end)
  });
  cp_async_wait<0>();  // (a key tile that no query sees never waited for its copy)
  write_dkv_rows<D>(dka, dva, scale, key_a, key_b, Nk, Hkv, kvh, blockIdx.y, t, dk, dv, part_dk, part_dv);
}

/// The dQ, then the dK / dV launch at head_dim D.
template <int D>
void launch_bwd(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const KvRange32* r, int Nq, int Nqp,
                int Nk, int H, int Hkv, float scale, bf16* dq, float* delta_t, float* lse2_t, const int4* tiles,
                int parts, int qpp, bf16* dk, bf16* dv, float* pdk, float* pdv, cudaStream_t s) {
  constexpr int W = kWarps;
  const size_t smem_dq = size_t((2 * 16 * W + 4 * BN) * (D + 8)) * sizeof(bf16);
  set_smem(dq_kernel<D, W>, smem_dq);
  dq_kernel<D, W><<<dim3((Nq + 16 * W - 1) / (16 * W), H), 32 * W, smem_dq, s>>>(q, k, v, dout, lse2_t, delta_t, r, Nq,
                                                                                   Nqp, Nk, H, Hkv, scale, dq);
  DFLASH_CUDA_CHECK_LAUNCH();
  const size_t smem_kv = size_t((2 * 16 * W + 4 * BM) * (D + 8)) * sizeof(bf16);
  set_smem(dkv_kernel<D, W>, smem_kv);
  dkv_kernel<D, W><<<dim3(((Nk + 16 * W - 1) / (16 * W)) * Hkv, parts), 32 * W, smem_kv, s>>>(
      q, k, v, dout, lse2_t, delta_t, r, tiles, Nq, Nqp, Nk, H, Hkv, scale, qpp, dk, dv, pdk, pdv);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_bwd_mma(int D, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const KvRange32* r,
                       int Nq, int Nqp, int Nk, int H, int Hkv, float scale, bf16* dq, float* delta_t, float* lse2_t,
                       const int4* tiles, int parts, int qpp, bf16* dk, bf16* dv, float* pdk, float* pdv,
                       cudaStream_t s) {
  if (D == 64)
    launch_bwd<64>(q, k, v, dout, r, Nq, Nqp, Nk, H, Hkv, scale, dq, delta_t, lse2_t, tiles, parts, qpp, dk, dv, pdk,
                   pdv, s);
  else if (D == 128)
    launch_bwd<128>(q, k, v, dout, r, Nq, Nqp, Nk, H, Hkv, scale, dq, delta_t, lse2_t, tiles, parts, qpp, dk, dv, pdk,
                    pdv, s);
  else
    throw std::invalid_argument("attention_bwd_mma: head_dim " + std::to_string(D) + " not in {64, 128}");
}

}  // namespace dflash::cuda::detail
