// The masked attention forward on Hopper (sm_90a, head_dim 128 and 256; masked_attention.h): the
// algorithm of attention_fwd_mma.cu with warpgroup MMAs. One CTA of two warpgroups per (128 query rows,
// head); warpgroup w owns rows 64 w .. 64 w + 63 (warp 4 w + i rows 16 i .. of them, as in the mma.sync
// kernel, so the softmax and epilogue are shared). Q, K and V tiles sit in shared memory with the
// 128-byte swizzle (wgmma.cuh): Q copied once by every thread (cp.async), each K / V tile by one thread
// through the TMA (tma.cuh), which spares the other threads the copies' address arithmetic (-8% per
// launch); S = Q K^T takes K from shared memory and Q's fragments from registers (loaded once; head_dim
// 128) or from shared memory (256), O += P V takes P from registers and V (MN-major) from shared
// memory. At head_dim 128 the next key tile's S is issued before this tile's softmax, so the tensor
// cores work while the warps exponentiate; at 256 the registers hold one S tile only, and the next
// tile's S is issued beside this tile's P V (P kept as bf16 fragments), with no barrier of the CTA
// between tiles. The two warpgroups take turns issuing their products (PingPong), so one's run while
// the other exponentiates.
#include <stdexcept>
#include <string>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/attention_softmax.cuh"
#include "ops/cuda/attention_wgmma.cuh"

namespace dflash::cuda::detail {

namespace {

template <int D, int WG, int N, bool kPrefetchS>
__global__ void __launch_bounds__(128 * WG, 1)
    fwd_wgmma_kernel(const bf16* __restrict__ q, const __grid_constant__ CUtensorMap tmk,
                     const __grid_constant__ CUtensorMap tmv, const KvRange32* __restrict__ ranges, int Nq, int Nk,
                     int H, int Hkv, float scale_log2, bf16* o, float* lse) {
  // head_dim 128: Q's fragments in registers, the next tile's S in flight during this tile's softmax
  // (kPrefetchS); 256: Q read from shared memory, the next tile's S in flight beside this tile's
  // P V, with P kept as bf16 fragments (the registers hold the 64 x 256 O accumulator besides).
  static_assert(D == 128 || D == 256, "head_dim 128 or 256");
  static_assert(N == 64, "S tiles of 64 keys (m64n64k16)");
  static_assert(kPrefetchS == (D == 128), "Q's fragments (128, ldmatrix) on the prefetching path; Q read by wgmma (256), after a proxy fence, on the other");
  constexpr bool kQregs = D == 128;
  static_assert(WG == 2, "PingPong pairs two warpgroups");
  constexpr int QR = 64 * WG, kThreads = 128 * WG, kBufs = fwd_wgmma_bufs(kPrefetchS);
  extern __shared__ __align__(16) unsigned char smem[];
  // Each tile as D / 64 swizzled [rows][64] column blocks (copy_rows_sw128).
  bf16* Qs = align_sw128(smem);  // [QR x D]
  bf16* Kb = Qs + QR * D;        // kBufs x [N x D]: tile j in buffer j % kBufs
  bf16* Vb = Kb + kBufs * N * D; // kBufs x [N x D]
  __shared__ int lohi[8];
  // 128: buffer b's K and V landed (one phase per tile); 256: K's ring, then V's
  __shared__ __align__(8) uint64_t kv_full[kPrefetchS ? kBufs : 2 * kBufs];
  __shared__ int released[2 * kBufs];  // 256: warps done with K's buffer b, V's buffer b (all per tile)
  const int h = blockIdx.y, kvh = h / (H / Hkv), row0 = (gridDim.x - 1 - blockIdx.x) * QR;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  copy_rows_sw128<D, kThreads, QR>(Qs, q, Nq, H, h, row0);  // one cp.async group
  cp_async_commit();
  if (!kPrefetchS && threadIdx.x < 2 * kBufs) released[threadIdx.x] = 0;
  if (threadIdx.x == 0) tma::init_ring(kv_full, kPrefetchS ? kBufs : 2 * kBufs);
  tile_union(ranges, Nq, row0, QR, lohi);  // (synchronizes)
  RowTile<D> rt;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) rt.oacc[i][0] = rt.oacc[i][1] = rt.oacc[i][2] = rt.oacc[i][3] = 0.f;
  rt.m_a = rt.m_b = -INFINITY, rt.l_a = rt.l_b = 0.f;
  const KeyTiles<N> tiles(lohi);
  auto fetch = [&](int j) {  // thread 0 starts tile j's K and V copies (TMA); nothing past the last
    if (threadIdx.x == 0 && j < tiles.n)
      tma::load_tile_pair<N, D>(Kb + (j % kBufs) * N * D, Vb + (j % kBufs) * N * D, &tmk, &tmv, &kv_full[j % kBufs],
                                kvh, tiles.start(j));
  };
  auto landed = [&](int j) { tma::wait_ring(kv_full, kBufs, j); };  // tile j visible to this thread
  uint32_t qa[kQregs ? D / 16 : 1][4];  // the warp's Q fragments (loaded once Q has landed)
  const bf16* Qw = Qs + (warp / 4) * 64 * 64;  // the warpgroup's 64 rows (column block 0)
  const PingPong pp(warp / 4);
  auto issue_s = [&](float (&s)[N / 8][4], int j) {  // S = Q K_j^T, committed, not waited for
    wgmma::fence();
    pp.turn();
    if constexpr (kQregs) rs_abt<D>(s, qa, Kb + (j % kBufs) * N * D);
    else ss_abt<D, QR>(s, Qw, Kb + (j % kBufs) * N * D);
    wgmma::commit();
    pp.pass();
  };
  const int ra = row0 + warp * 16 + g, rb = ra + 8;
  auto softmax_pv = [&](int j, float (&sc)[N / 8][4]) {  // O += softmax(S_j) V_j, waited for
    const int seg = tiles.seg(j), k0 = tiles.start(j);
    online_softmax<D, N>(sc, rt, tile_full(lohi, seg, k0, N, Nk), ranges, ra, rb, Nq, k0, seg, Nk, t, scale_log2);
    rs_ab<N, D>(rt.oacc, sc, Vb + (j % kBufs) * N * D);
    wgmma::commit();
    wgmma::wait<0>();
  };
  if constexpr (!kPrefetchS) {
    // K and V in rings of two buffers each (tile j's in buffer j % 2). Step j issues S_{j+1} =
    // Q K_{j+1}^T and O += P_j V_j in one turn, so that the tensor cores run one warpgroup's two
    // products while the other warpgroup exponentiates (FlashAttention-3's intra-warpgroup overlap,
    // section 3.2), and O is rescaled once P_j V_j is done. No barrier of the CTA between steps: each
    // warp releases a buffer once its products are done with it, and the last of the CTA's warps to
    // release one starts the copy of the tile two further into it (K_{j+2} once every S_j is done,
    // V_{j+2} once every P_j V_j is), so the two warpgroups stay half a step apart.
    uint64_t* k_full = kv_full;
    uint64_t* v_full = kv_full + kBufs;
    auto load = [&](bool key, int j) {  // tile j's K (or V) into buffer j % 2; nothing past the last
      if (j < tiles.n)
        tma::load_tile<N, D>((key ? Kb : Vb) + (j % 2) * N * D, key ? &tmk : &tmv, (key ? k_full : v_full) + j % 2,
                             kvh, tiles.start(j));
    };
    auto release = [&](bool key, int j) {  // this warp is done with tile j's K (or V)
      if (lane == 0) {
        __threadfence_block();  // (ordered before the other warps' view of the count)
        if (atomicAdd(&released[(key ? 0 : kBufs) + j % 2], 1) % (kThreads / 32) == kThreads / 32 - 1) {
          __threadfence_block();
          load(key, j + 2);
        }
      }
    };
    auto scores = [&](int j, float (&sc)[N / 8][4]) {  // tile j's online softmax; O's factors
      const int seg = tiles.seg(j), k0 = tiles.start(j);
      return online_softmax_scores<D, N, true>(sc, rt, tile_full(lohi, seg, k0, N, Nk), ranges, ra, rb, Nq, k0, seg,
                                               Nk, t, scale_log2);
    };
    if (threadIdx.x == 0) load(true, 0), load(false, 0), load(true, 1), load(false, 1);
    cp_async_wait<0>();  // Q, read by wgmma (the async proxy)
    wgmma::fence_proxy_async();
    __syncthreads();  // Q visible to every warp
    float sc[N / 8][4];
    uint32_t pa[N / 16][4];  // P_j, the A fragments of O += P_j V_j
    if (tiles.n > 0) tma::wait_ring(k_full, kBufs, 0);
    issue_s(sc, 0);  // (with no tile, of a buffer never written, and never read)
    wgmma::wait<0>();
    if (tiles.n > 0) {
      release(true, 0);
      scores(0, sc);  // (O is zero: nothing to rescale)
    }
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) acc_to_a(pa[kk], sc, kk);
    for (int j = 0; j < tiles.n; ++j) {
      const bool more = j + 1 < tiles.n;
      if (more) tma::wait_ring(k_full, kBufs, j + 1);
      tma::wait_ring(v_full, kBufs, j);
      wgmma::fence();
      pp.turn();
      // S_{j+1}; after the last tile, tile j's again, never read (no branch around a wgmma: the
      // compiler would serialize them all)
      ss_abt<D, QR>(sc, Qw, Kb + ((more ? j + 1 : j) % 2) * N * D);
      wgmma::commit();
      rs_ab_frags<N, D>(rt.oacc, pa, Vb + (j % 2) * N * D);  // O += P_j V_j
      wgmma::commit();
      pp.pass();
      wgmma::wait<1>();  // S_{j+1}
      Rescale c{1.f, 1.f, true};
      if (more) {
        release(true, j + 1);
        c = scores(j + 1, sc);
      }
      wgmma::wait<0>();  // P_j V_j
      release(false, j);
      rescale_o(rt, c);
#pragma unroll
      for (int kk = 0; kk < N / 16; ++kk) acc_to_a(pa[kk], sc, kk);
    }
  } else {
    // Tile j: S_j was issued one step earlier, so the tensor cores compute S_{j+1} while this
    // warpgroup runs tile j's softmax. Buffers: four (tile j, tile j + 1 landed, tile j + 2 in flight,
    // tile j - 1 possibly still read by a warp behind).
    auto step = [&](int j, float (&sc)[N / 8][4], float (&sn)[N / 8][4]) {
      fetch(j + 2);  // into tile j - 2's buffer
      if (j + 1 < tiles.n) landed(j + 1);  // (j + 2 may be in flight)
      __syncthreads();
      // S_{j+1}; after the last tile, tile j again, never read (no branch around a wgmma: the
      // compiler would serialize them all).
      issue_s(sn, min(j + 1, tiles.n - 1));  // in flight during this tile's softmax
      softmax_pv(j, sc);
    };
    float s0[N / 8][4], s1[N / 8][4];
    fetch(0);
    fetch(1);
    cp_async_wait<0>();  // Q
    if (tiles.n > 0) landed(0);
    __syncthreads();
    if constexpr (kQregs)
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) load_a_sw128(qa[ks], Qs, QR, warp * 16, ks * 16, lane);
    issue_s(s0, 0);  // (with no tile, of a buffer never written, and never read)
    wgmma::wait<0>();  // (no wgmma in flight across a branch: the compiler would serialize them all)
    for (int j = 0; j < tiles.n; ++j) {
      step(j, s0, s1);
#pragma unroll
      for (int nt = 0; nt < N / 8; ++nt)  // S_{j+1} (complete: step waited for every wgmma)
#pragma unroll
        for (int e = 0; e < 4; ++e) s0[nt][e] = s1[nt][e];
    }
  }
  pp.finish();
  write_rows(rt, o, lse, ra, rb, Nq, H, h, t);
}

/// The Hopper forward: head_dim 128 with 64-key tiles, four buffers (161 KB of shared memory), 256
/// with 64-key tiles, two buffers (193 KB); one CTA per SM.
template <int D>
void launch_fwd_wgmma(const bf16* q, const bf16* k, const bf16* v, const KvRange32* r, int Nq, int Nk, int H,
                      int Hkv, float scale, bf16* o, float* lse, cudaStream_t s) {
  // (3 warpgroups leave no registers for two S tiles; at head_dim 256, 32-key tiles with the next S
  // prefetched measured 18.5 ms against 15.7 for a 64-key path without, in the 27B target forward's
  // attention stage; its path now keeps one S tile and P as bf16 fragments)
  constexpr bool kPrefetchS = D == 128;
  constexpr int WG = 2, N = 64, QR = 64 * WG;
  const size_t smem = size_t(QR + 2 * fwd_wgmma_bufs(kPrefetchS) * N) * D * sizeof(bf16) + 1024;  // + the swizzle atoms' alignment
  const CUtensorMap tmk = tma::rows_map(k, Nk, Hkv, D, N, "masked_attention_forward (k)");
  const CUtensorMap tmv = tma::rows_map(v, Nk, Hkv, D, N, "masked_attention_forward (v)");
  set_smem(fwd_wgmma_kernel<D, WG, N, kPrefetchS>, smem);
  fwd_wgmma_kernel<D, WG, N, kPrefetchS><<<dim3((Nq + QR - 1) / QR, H), 128 * WG, smem, s>>>(
      q, tmk, tmv, r, Nq, Nk, H, Hkv, scale * kLog2e, o, lse);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_fwd_wgmma(int D, const bf16* q, const bf16* k, const bf16* v, const KvRange32* r, int Nq, int Nk, int H,
                         int Hkv, float scale, bf16* o, float* lse, cudaStream_t s) {
  switch (D) {
    case 128: return launch_fwd_wgmma<128>(q, k, v, r, Nq, Nk, H, Hkv, scale, o, lse, s);
    case 256: return launch_fwd_wgmma<256>(q, k, v, r, Nq, Nk, H, Hkv, scale, o, lse, s);
    default: throw std::invalid_argument("attention_fwd_wgmma: head_dim " + std::to_string(D) + " not in {128, 256}");
  }
}

}  // namespace dflash::cuda::detail
