// The masked attention backward on Hopper (sm_90a, head_dim 128; masked_attention.h): the two kernels
// of attention_bwd_mma.cu with warpgroup MMAs on the forward's swizzled tiles (rs_abt / ss_abt for the
// scores, rs_ab for the products with the probabilities). In dQ the two score products are committed as
// two groups, so P's exponentials run while the tensor cores compute dP. (The same in dK / dV, with P^T
// dO in flight while dS^T is formed, measured 1.64 against 1.62 ms for the plain order below, and
// spilled registers.) Both kernels take turns between their warpgroups (PingPong) and keep three
// buffers, one barrier per tile or item. The tiles that stream (K / V in dQ, Q / dO in dK / dV) come
// through the TMA; the ones loaded once per CTA and the row statistics through cp.async.
#include "ops/cuda/attention_bwd_common.cuh"
#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/attention_wgmma.cuh"

namespace dflash::cuda::detail {

namespace {

/// dQ: one CTA of two warpgroups per (128 query rows, head), warpgroup w rows 64 w .. 64 w + 63
/// (warp 4 w + i rows 16 i ..), as fwd_wgmma_kernel; keys 64 at a time, three buffers.
template <int D, int WG, int N>
__global__ void __launch_bounds__(128 * WG, 1)
    dq_wgmma_kernel(const bf16* __restrict__ q, const __grid_constant__ CUtensorMap tmk,
                    const __grid_constant__ CUtensorMap tmv, const bf16* __restrict__ dout,
                    const float* __restrict__ lse2_t, const float* __restrict__ delta_t,
                    const KvRange32* __restrict__ ranges, int Nq, int Nqp, int Nk, int H, int Hkv, float scale, bf16* dq) {
  static_assert(D == 128 && N == 64, "m64n64 score tiles, one m64n128 product per output row");
  static_assert(WG == 2, "PingPong pairs two warpgroups");
  constexpr int QR = 64 * WG, kThreads = 128 * WG, kBufs = kBwdWgmmaBufs;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = align_sw128(smem);   // [QR x D]
  bf16* Os = Qs + QR * D;         // dO [QR x D]
  bf16* Kb = Os + QR * D;         // kBufs x [N x D]: tile j in buffer j % kBufs
  bf16* Vb = Kb + kBufs * N * D;  // kBufs x [N x D]
  __shared__ int lohi[8];
  __shared__ __align__(8) uint64_t kv_full[kBufs];  // buffer b's K and V landed (one phase per tile)
  const int h = blockIdx.y, kvh = h / (H / Hkv), row0 = (gridDim.x - 1 - blockIdx.x) * QR;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale_log2 = scale * kLog2e;
  copy_rows_sw128<D, kThreads, QR>(Qs, q, Nq, H, h, row0);  // Q and dO: one cp.async group
  copy_rows_sw128<D, kThreads, QR>(Os, dout, Nq, H, h, row0);
  cp_async_commit();
  if (threadIdx.x == 0) tma::init_ring(kv_full, kBufs);
  const int ra = row0 + warp * 16 + g, rb = ra + 8;
  const KvRange32 rga = ra < Nq ? ranges[ra] : KvRange32{}, rgb = rb < Nq ? ranges[rb] : KvRange32{};
  // (rows past Nq, which may lie past Nqp too, see no key: their statistics are not read)
  const int64_t hrow = int64_t(h) * Nqp;
  const float lse_a = ra < Nq ? lse2_t[hrow + ra] : 0.f, lse_b = rb < Nq ? lse2_t[hrow + rb] : 0.f;
  const float dl_a = ra < Nq ? delta_t[hrow + ra] : 0.f, dl_b = rb < Nq ? delta_t[hrow + rb] : 0.f;
  tile_union(ranges, Nq, row0, QR, lohi);  // (synchronizes)
  const KeyTiles<N> tiles(lohi);
  auto fetch = [&](int j) {  // thread 0 starts tile j's K and V copies (TMA); nothing past the last
    if (threadIdx.x == 0 && j < tiles.n)
      tma::load_tile_pair<N, D>(Kb + (j % kBufs) * N * D, Vb + (j % kBufs) * N * D, &tmk, &tmv, &kv_full[j % kBufs],
                                kvh, tiles.start(j));
  };
  uint32_t qa[D / 16][4], oa[D / 16][4];  // the warp's Q and dO fragments (loaded once they landed)
  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const PingPong pp(warp / 4);
  fetch(0);
  for (int j = 0; j < tiles.n; ++j) {
    fetch(j + 1);        // into tile j - 2's buffer: every warp was done with it at step j - 1's barrier
    cp_async_wait<0>();  // Q and dO (read by ldmatrix)
    tma::wait_ring(kv_full, kBufs, j);  // tile j
    __syncthreads();
    if (j == 0)
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        load_a_sw128(qa[ks], Qs, QR, warp * 16, ks * 16, lane);
        load_a_sw128(oa[ks], Os, QR, warp * 16, ks * 16, lane);
      }
    const bf16* Kj = Kb + (j % kBufs) * N * D;
    float s[N / 8][4], dp[N / 8][4];
    wgmma::fence();
    pp.turn();
    rs_abt<D>(s, qa, Kj);  // S = Q K^T
    wgmma::commit();
    rs_abt<D>(dp, oa, Vb + (j % kBufs) * N * D);  // dP = dO V^T
    wgmma::commit();
    pp.pass();
    wgmma::wait<1>();  // S (dP in flight)
    const int seg = tiles.seg(j), k0 = tiles.start(j);
    dq_probs<N>(s, tile_full(lohi, seg, k0, N, Nk), rga, rgb, lse_a, lse_b, k0, seg, Nk, t, scale_log2);
    wgmma::wait<0>();  // dP
    dq_dscores<N>(s, dp, dl_a, dl_b);
    rs_ab<N>(acc, s, Kj);  // dQ += dS K (scaled at the end)
    wgmma::commit();
    wgmma::wait<0>();
  }
  pp.finish();
  cp_async_wait<0>();  // (a query tile that sees no key never waited for its copy)
  write_dq_rows<D>(acc, scale, dq, ra, rb, Nq, H, h, t);
}

/// dK, dV: one CTA of two warpgroups per (128 keys, kv head, part), warpgroup w keys 64 w ..
/// 64 w + 63 (warp 4 w + i keys 16 i ..); items and epilogue as dkv_kernel (never split in parts).
/// S^T = K Q^T
/// and dP^T = V dO^T read K, V, Q and dO K-major; P^T dO and dS^T Q read dO and Q MN-major.
template <int D, int WG>
__global__ void __launch_bounds__(128 * WG, 1)
    dkv_wgmma_kernel(const __grid_constant__ CUtensorMap tmq, const bf16* __restrict__ k, const bf16* __restrict__ v,
                     const __grid_constant__ CUtensorMap tmo, const float* __restrict__ lse2_t,
                     const float* __restrict__ delta_t,
                     const KvRange32* __restrict__ ranges, const int4* __restrict__ tiles, int Nq, int Nqp, int Nk, int H,
                     int Hkv, float scale, int qpp, bf16* dk, bf16* dv, float* part_dk, float* part_dv) {
  static_assert(D == 128 && BM == 64, "m64n64 score tiles, one m64n128 product per key row");
  constexpr int KR = 64 * WG, kThreads = 128 * WG;
  extern __shared__ __align__(16) unsigned char smem[];
  static_assert(WG == 2, "PingPong pairs two warpgroups");
  constexpr int kBufs = kBwdWgmmaBufs;
  bf16* Ks = align_sw128(smem);      // [KR x D]
  bf16* Vs = Ks + KR * D;            // [KR x D]
  bf16* Qb = Vs + KR * D;            // kBufs x [BM x D]
  bf16* Ob = Qb + kBufs * BM * D;    // dO, kBufs x [BM x D]
  __shared__ __align__(16) float s_lse_b[kBufs][BM], s_delta_b[kBufs][BM];
  __shared__ __align__(16) KvRange32 s_rg_b[kBufs][BM];
  __shared__ __align__(8) uint64_t qo_full[kBufs];  // buffer b's Q and dO landed (one phase per item)
  const int kvh = blockIdx.x % Hkv, k0 = (blockIdx.x / Hkv) * KR, G = H / Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale_log2 = scale * kLog2e;
  copy_rows_sw128<D, kThreads, KR>(Ks, k, Nk, Hkv, kvh, k0);  // K and V land with the first item
  copy_rows_sw128<D, kThreads, KR>(Vs, v, Nk, Hkv, kvh, k0);
  const int key_a = k0 + warp * 16 + g, key_b = key_a + 8;
  const bf16* Kw = Ks + (warp / 4) * 64 * 64;  // this warpgroup's keys in column block 0
  const bf16* Vw = Vs + (warp / 4) * 64 * 64;
  float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[i][e] = dva[i][e] = 0.f;
  const int qt_begin = blockIdx.y * qpp;
  DkvItems items(tiles, k0, KR, qt_begin, min((Nq + BM - 1) / BM, qt_begin + qpp), G);
  if (threadIdx.x == 0) tma::init_ring(qo_full, kBufs);
  __syncthreads();  // the barriers are ready before any thread waits on one
  auto issue = [&](int qt, int hi, int buf) {  // Q and dO by TMA (thread 0), the row statistics by cp.async
    const int row0 = qt * BM, h = kvh * G + hi;
    if (threadIdx.x == 0)
      tma::load_tile_pair<BM, D>(Qb + buf * BM * D, Ob + buf * BM * D, &tmq, &tmo, &qo_full[buf], h, row0);
    copy_row_stats(s_lse_b[buf], s_delta_b[buf], s_rg_b[buf], lse2_t, delta_t, ranges, h, row0, Nq, Nqp);
  };
  auto landed = [&](int i) { tma::wait_ring(qo_full, kBufs, i); };  // item i, in buffer i % kBufs
  const PingPong pp(warp / 4);
  for_each_item<true, kBufs>(items, Nk, issue, landed, [&](int qt, int buf, bool full) {
    const bf16* Qt = Qb + buf * BM * D;
    const bf16* Ot = Ob + buf * BM * D;
    float st[BM / 8][4], dpt[BM / 8][4];  // [keys of the warpgroup] x [queries]
    wgmma::fence();
    pp.turn();
    ss_abt<D, KR>(st, Kw, Qt);   // S^T = K Q^T
    ss_abt<D, KR>(dpt, Vw, Ot);  // dP^T = V dO^T
    wgmma::commit();
    pp.pass();
    wgmma::wait<0>();
    dkv_probs<BM / 8>(st, full, s_lse_b[buf], s_rg_b[buf], qt * BM, Nq, Nk, key_a, key_b, t, scale_log2);
    dkv_dscores<BM / 8>(dpt, st, s_delta_b[buf], t);
    rs_ab<BM>(dva, st, Ot);   // dV += P^T dO
    rs_ab<BM>(dka, dpt, Qt);  // dK += dS^T Q (scaled at the end)
    wgmma::commit();
    wgmma::wait<0>();
  });
  pp.finish();
  cp_async_wait<0>();  // (a key tile that no query sees never waited for its copy)
  write_dkv_rows<D>(dka, dva, scale, key_a, key_b, Nk, Hkv, kvh, blockIdx.y, t, dk, dv, part_dk, part_dv);
}

}  // namespace

void attention_bwd_wgmma(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const KvRange32* r, int Nq,
                         int Nqp, int Nk, int H, int Hkv, float scale, bf16* dq, float* delta_t, float* lse2_t,
                         const int4* tiles, int parts, int qpp, bf16* dk, bf16* dv, float* pdk, float* pdv,
                         cudaStream_t s) {
  constexpr int D = 128, WG = 2, N = 64, QR = 64 * WG, KR = 64 * WG;
  const size_t smem_dq = size_t(2 * QR + 2 * kBwdWgmmaBufs * N) * D * sizeof(bf16) + 1024;  // Q, dO, K / V buffers; + alignment
  const CUtensorMap tmk = tma::rows_map(k, Nk, Hkv, D, N, "masked_attention_backward (k)");
  const CUtensorMap tmv = tma::rows_map(v, Nk, Hkv, D, N, "masked_attention_backward (v)");
  const CUtensorMap tmq = tma::rows_map(q, Nq, H, D, BM, "masked_attention_backward (q)");
  const CUtensorMap tmo = tma::rows_map(dout, Nq, H, D, BM, "masked_attention_backward (dout)");
  set_smem(dq_wgmma_kernel<D, WG, N>, smem_dq);
  dq_wgmma_kernel<D, WG, N><<<dim3((Nq + QR - 1) / QR, H), 128 * WG, smem_dq, s>>>(q, tmk, tmv, dout, lse2_t, delta_t, r, Nq,
                                                                                  Nqp, Nk, H, Hkv, scale, dq);
  DFLASH_CUDA_CHECK_LAUNCH();
  const size_t smem_kv = size_t(2 * KR + 2 * kBwdWgmmaBufs * BM) * D * sizeof(bf16) + 1024;  // K, V, Q / dO buffers
  set_smem(dkv_wgmma_kernel<D, WG>, smem_kv);
  dkv_wgmma_kernel<D, WG><<<dim3(((Nk + KR - 1) / KR) * Hkv, parts), 128 * WG, smem_kv, s>>>(
      tmq, k, v, tmo, lse2_t, delta_t, r, tiles, Nq, Nqp, Nk, H, Hkv, scale, qpp, dk, dv, pdk, pdv);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda::detail
