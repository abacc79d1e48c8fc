#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "ops/cuda/device_info.h"
#include "ops/cuda/fast_math.cuh"
#include "ops/cuda/masked_attention.h"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/tma.cuh"
#include "ops/cuda/wgmma.cuh"

namespace dflash::cuda {

namespace {

using namespace mma;

// Tiles: the dQ kernel gives each of its W warps 16 query rows (16 W rows per CTA), the forward 16 or
// 32 (fwd_mtiles), and both walk keys 64 at a time (32 at head_dim 256 in the forward); the dK/dV
// kernel gives each warp 16 keys and walks queries 64 at a time.
constexpr int BM = 64;  // query rows per tile in the dK / dV kernel (and in its tile table)
constexpr int BN = 64;  // keys per tile in the dQ kernel and the forward's default (fwd_keys)
constexpr int kWarps = 4;
constexpr float kLn2 = 0.6931471805599453f;

/// A fragment for keys/queries 16kk..16kk+15 from an accumulator tile array c[n-tile][4].
__device__ __forceinline__ void acc_to_a(uint32_t a[4], const float (*c)[4], int kk) {
  a[0] = pack(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

/// acc [16 x D] (D/8 accumulator tiles) += A @ M: A [16 x K] in accumulator layout (c, K/8 tiles,
/// rounded to bf16), M [K][D] row-major in shared memory (leading dimension ld). The P.V, dS.K,
/// P^T.dO and dS^T.Q products of the kernels.
template <int D, int K>
__device__ __forceinline__ void acc_times_smem(float (*acc)[4], const float (*c)[4], const bf16* m, int ld, int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    acc_to_a(a, c, kk);
#pragma unroll
    for (int dt = 0; dt < D / 8; dt += 2) {
      uint32_t b[4];
      load_b_trans_x4(b, m, ld, kk * 16, dt * 8, lane);
      mma16816(acc[dt], a, b[0], b[1]);
      mma16816(acc[dt + 1], a, b[2], b[3]);
    }
  }
}

/// c [16 x N] (N/8 accumulator tiles) = A @ M^T: A [16 x D] as D/16 register fragments, M [N][D]
/// row-major in shared memory. The Q.K^T and dO.V^T products of the query-tile kernels.
template <int D, int N>
__device__ __forceinline__ void frag_times_smem_t(float (*c)[4], const uint32_t (*a)[4], const bf16* m, int ld, int lane) {
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
      uint32_t b[4];
      load_b_x4(b, m, ld, nt * 8, kk * 16, lane);
      mma16816(c[nt], a[kk], b[0], b[1]);
      mma16816(c[nt + 1], a[kk], b[2], b[3]);
    }
}

__device__ __forceinline__ bool visible(const KvRange32& r, int key) {
  return (key >= r.ctx_begin && key < r.ctx_end) || (key >= r.blk_begin && key < r.blk_end);
}
/// Visible through range `seg` only (0 = ctx, 1 = blk). The query-tile kernels walk the union of the
/// ctx ranges, then the union of the blk ranges; those unions may overlap across rows, so each pass
/// admits only its own range and no key is counted twice for a row.
__device__ __forceinline__ bool visible_in(const KvRange32& r, int key, int seg) {
  return seg == 0 ? (key >= r.ctx_begin && key < r.ctx_end) : (key >= r.blk_begin && key < r.blk_end);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// cp.async (sm_80+): the next tile is fetched while the current one is computed on (double buffering).
/// Waits until at most one committed group (the newest) is still in flight.
__device__ __forceinline__ void cp_async_wait_prev() { cp_async_wait<1>(); }

/// Copies kRows rows [r0, r0 + kRows) of one head of a [N, heads, D] bf16 tensor into shared memory
/// [kRows][ld] with cp.async, 16 bytes per copy (rows past N zero-filled); completes at a later wait.
/// The block's kThreads threads split each row into D / 8 column chunks: thread i copies chunk
/// i % (D / 8) of rows i / (D / 8) + k kStep (shifts, one 64-bit address, then a pointer add per copy).
template <int D, int kThreads, int kRows>
__device__ __forceinline__ void copy_rows_async(bf16* dst, int ld, const bf16* src, int N, int heads, int head, int r0) {
  constexpr int kChunks = D / 8, kStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kStep == 0, "whole rows per step, whole steps per tile");
  const int row = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
  const int64_t stride = int64_t(heads) * D;
  bf16* d = dst + row * ld + col;
  const bf16* s = src + int64_t(r0 + row) * stride + int64_t(head) * D + col;
  if (r0 + kRows <= N) {
#pragma unroll
    for (int k = 0; k < kRows / kStep; ++k) cp_async16(d + k * kStep * ld, s + k * kStep * stride, true);
  } else {
#pragma unroll
    for (int k = 0; k < kRows / kStep; ++k) {
      const bool ok = r0 + row + k * kStep < N;
      cp_async16(d + k * kStep * ld, ok ? s + k * kStep * stride : src, ok);
    }
  }
}

/// Key tiles of a query tile: the ctx union [lohi[0], lohi[1]) then the blk union [lohi[2], lohi[3]),
/// N keys each. Tile j starts at start(j) and belongs to range seg(j).
template <int N>
struct KeyTiles {
  int lo0, n0, lo1, n;
  __device__ KeyTiles(const int* lohi) {
    lo0 = lohi[0], lo1 = lohi[2];
    n0 = lohi[1] > lohi[0] ? (lohi[1] - lohi[0] + N - 1) / N : 0;
    n = n0 + (lohi[3] > lohi[2] ? (lohi[3] - lohi[2] + N - 1) / N : 0);
  }
  __device__ int start(int j) const { return j < n0 ? lo0 + j * N : lo1 + (j - n0) * N; }
  __device__ int seg(int j) const { return j < n0 ? 0 : 1; }
};

/// The key / value tiles of a query tile, double-buffered in shared memory (Kb, Vb: 2 x [N][D + 8]):
/// tile j lives in buffer j & 1; fetch(j + 1) is queued before tile j is waited for.
template <int D, int N, int kThreads>
struct KvPipeline {
  KeyTiles<N> tiles;
  bf16 *Kb, *Vb;
  const bf16 *k, *v;
  int Nk, Hkv, kvh;
  static constexpr int LD = D + 8;
  __device__ KvPipeline(const int* lohi, bf16* Kb, bf16* Vb, const bf16* k, const bf16* v, int Nk, int Hkv, int kvh)
      : tiles(lohi), Kb(Kb), Vb(Vb), k(k), v(v), Nk(Nk), Hkv(Hkv), kvh(kvh) {}
  __device__ bf16* K(int j) const { return Kb + (j & 1) * N * LD; }
  __device__ bf16* V(int j) const { return Vb + (j & 1) * N * LD; }
  /// Queues tile j (nothing past the last) and commits the group (with any copies queued before).
  __device__ void fetch(int j) const {
    if (j < tiles.n) {
      copy_rows_async<D, kThreads, N>(K(j), LD, k, Nk, Hkv, kvh, tiles.start(j));
      copy_rows_async<D, kThreads, N>(V(j), LD, v, Nk, Hkv, kvh, tiles.start(j));
    }
    cp_async_commit();
  }
  /// Queues tile j + 1, then waits until tile j has landed and every thread sees it.
  __device__ void wait(int j) const {
    fetch(j + 1);
    cp_async_wait_prev();
    __syncthreads();
  }
};

/// Every row of the query tile sees all `width` keys from k0 through range `seg` (see tile_union).
__device__ __forceinline__ bool tile_full(const int* lohi, int seg, int k0, int width, int Nk) {
  return k0 >= lohi[4 + 2 * seg] && k0 + width <= lohi[5 + 2 * seg] && k0 + width <= Nk;
}

/// Union and intersection of the ranges of query rows [row0, row0 + rows):
/// lohi = {ctx lo, ctx hi, blk lo, blk hi} (union) and lohi[4..7] = the same for the intersection
/// (empty when some row of the tile has an empty range of that kind, or the tile runs past Nq).
/// A key tile inside the intersection is visible to every row: no per-element mask is needed.
__device__ void tile_union(const KvRange32* ranges, int Nq, int row0, int rows, int* lohi) {
  if (threadIdx.x == 0) {
    lohi[0] = lohi[2] = INT_MAX, lohi[1] = lohi[3] = INT_MIN;
    lohi[4] = lohi[6] = INT_MIN, lohi[5] = lohi[7] = row0 + rows <= Nq ? INT_MAX : INT_MIN;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows && row0 + i < Nq; i += blockDim.x) {
    const KvRange32 r = ranges[row0 + i];
    if (r.ctx_end > r.ctx_begin) {
      atomicMin(&lohi[0], r.ctx_begin), atomicMax(&lohi[1], r.ctx_end);
      atomicMax(&lohi[4], r.ctx_begin), atomicMin(&lohi[5], r.ctx_end);
    } else {
      atomicMin(&lohi[5], INT_MIN);
    }
    if (r.blk_end > r.blk_begin) {
      atomicMin(&lohi[2], r.blk_begin), atomicMax(&lohi[3], r.blk_end);
      atomicMax(&lohi[6], r.blk_begin), atomicMin(&lohi[7], r.blk_end);
    } else {
      atomicMin(&lohi[7], INT_MIN);
    }
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Forward: one CTA per (query tile, head); warp w owns MT 16-row m-tiles (rows 16 MT w ..
// 16 MT w + 16 MT - 1 of the tile); keys N at a time. With MT 1 the warp keeps its query fragments
// in registers (the query tile is staged in the key / value buffers); with MT 2 the query tile stays
// in shared memory and each key / value fragment loaded from shared memory serves both m-tiles
// (FlashAttention-2's layout: half the shared-memory reads per product).

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

template <int D, int W, int N, int MT>
__global__ void __launch_bounds__(32 * W, MT == 2 ? 2 : (D <= 128 ? 3 : 2))
    fwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
               const KvRange32* __restrict__ ranges, int Nq, int Nk, int H, int Hkv, float scale_log2, bf16* o,
               float* lse) {
  constexpr int LD = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int QR = 16 * W * MT;
  static_assert(MT == 2 || QR <= 4 * N, "the query tile is staged in the key / value buffers");
  bf16* Qs = reinterpret_cast<bf16*>(smem);   // [QR][LD]: MT 2 for the whole kernel, MT 1 until the first key tile
  bf16* Kb = MT == 2 ? Qs + QR * LD : Qs;     // 2 x [N][LD]
  bf16* Vb = Kb + 2 * N * LD;                 // 2 x [N][LD]
  __shared__ int lohi[8];
  // Query tiles in reverse: later rows see more keys (causal, and DFlash anchors are sorted), so
  // the longest tiles start first and the short ones fill the end of the launch.
  const int h = blockIdx.y, kvh = h / (H / Hkv), row0 = (gridDim.x - 1 - blockIdx.x) * QR;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wrow = warp * 16 * MT;  // the warp's first row in the tile
  // The query tile is copied while the ranges are scanned. MT 1: it is waited for here; MT 2: it
  // lands with the first key tile (one cp.async group).
  copy_rows_async<D, 32 * W, QR>(Qs, LD, q, Nq, H, h, row0);
  if constexpr (MT == 1) cp_async_commit();
  tile_union(ranges, Nq, row0, QR, lohi);  // (synchronizes)
  uint32_t qa[MT == 1 ? D / 16 : 1][4];
  if constexpr (MT == 1) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_a_x4(qa[kk], Qs, LD, wrow, kk * 16, lane);
    __syncthreads();  // every warp holds its Q fragments before the key buffers are filled
  }
  RowTile<D> rt[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) rt[mt].oacc[i][0] = rt[mt].oacc[i][1] = rt[mt].oacc[i][2] = rt[mt].oacc[i][3] = 0.f;
    rt[mt].m_a = rt[mt].m_b = -INFINITY, rt[mt].l_a = rt[mt].l_b = 0.f;
  }

  const KvPipeline<D, N, 32 * W> kv(lohi, Kb, Vb, k, v, Nk, Hkv, kvh);
  kv.fetch(0);
  for (int j = 0; j < kv.tiles.n; ++j) {
    const int seg = kv.tiles.seg(j), k0 = kv.tiles.start(j);
    const bf16* Ks = kv.K(j);
    const bf16* Vs = kv.V(j);
    kv.wait(j);
    float s[MT][N / 8][4];
    if constexpr (MT == 1) {
      frag_times_smem_t<D, N>(s[0], qa, Ks, LD, lane);  // S = Q K^T
    } else {  // S = Q K^T for both m-tiles, each K fragment loaded once
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a_x4(a[mt], Qs, LD, wrow + 16 * mt, kk * 16, lane);
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
          uint32_t b[4];
          load_b_x4(b, Ks, LD, nt * 8, kk * 16, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma16816(s[mt][nt], a[mt], b[0], b[1]);
            mma16816(s[mt][nt + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    const bool full = tile_full(lohi, seg, k0, N, Nk);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int ra = row0 + wrow + 16 * mt + g;
      online_softmax<D, N>(s[mt], rt[mt], full, ranges, ra, ra + 8, Nq, k0, seg, Nk, t, scale_log2);
    }
    if constexpr (MT == 1) {
      acc_times_smem<D, N>(rt[0].oacc, s[0], Vs, LD, lane);  // O += P V
    } else {  // O += P V for both m-tiles, each V fragment loaded once
#pragma unroll
      for (int kk = 0; kk < N / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], s[mt], kk);
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
          uint32_t b[4];
          load_b_trans_x4(b, Vs, LD, kk * 16, dt * 8, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma16816(rt[mt].oacc[dt], a[mt], b[0], b[1]);
            mma16816(rt[mt].oacc[dt + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  cp_async_wait<0>();  // (with MT 2, a query tile that sees no key never waited for its copy)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int ra = row0 + wrow + 16 * mt + g;
    write_rows(rt[mt], o, lse, ra, ra + 8, Nq, H, h, t);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward on Hopper (sm_90a, head_dim 128 and 256): the same algorithm with warpgroup MMAs. One CTA
// of two warpgroups per (128 query rows, head); warpgroup w owns rows 64 w .. 64 w + 63 (warp 4 w + i
// rows 16 i .. of them, as in the mma.sync kernel, so the softmax and epilogue are shared). Q, K and
// V tiles sit in shared memory with the 128-byte swizzle (wgmma.cuh): Q copied once by every thread
// (cp.async), each K / V tile by one thread through the TMA (tma.cuh), which spares the other
// threads the copies' address arithmetic (-8% per launch); S = Q K^T takes K from shared
// memory and Q's fragments from registers (loaded once; head_dim 128) or from shared memory (256),
// O += P V takes P from registers and V (MN-major) from shared memory. At head_dim 128 the next key
// tile's S is issued before this tile's softmax, so the tensor cores work while the warps
// exponentiate; at 256 the registers hold one S tile only, and the next tile's S is issued beside
// this tile's P V (P kept as bf16 fragments), with no barrier of the CTA between tiles. The two
// warpgroups take turns issuing their products (PingPong), so one's run while the other exponentiates.

/// copy_rows_async into wgmma's 128-byte-swizzled layout: the [kRows][D] tile as D / 64 column
/// blocks of [kRows][64]; row r of a block at r 128 bytes, its 16-byte chunk c at ((c ^ r % 8) 16).
/// Consecutive threads fill consecutive 16 bytes of shared memory (conflict-free), reading the
/// 128 bytes of one row's block in a permuted order (still one coalesced segment).
template <int D, int kThreads, int kRows>
__device__ __forceinline__ void copy_rows_sw128(bf16* dst, const bf16* src, int N, int heads, int head, int r0) {
  constexpr int kUnits = kRows * D / 8;
  const int64_t stride = int64_t(heads) * D;
  const bf16* s = src + int64_t(head) * D;
#pragma unroll
  for (int k = 0; k < (kUnits + kThreads - 1) / kThreads; ++k) {
    const int L = int(threadIdx.x) + k * kThreads;  // 16-byte unit of the tile in shared memory
    if (kUnits % kThreads != 0 && L >= kUnits) break;
    const int blk = L / (kRows * 8), r = (L / 8) % kRows, c = (L % 8) ^ (r % 8);
    const bool ok = r0 + r < N;
    cp_async16(dst + L * 8, ok ? s + int64_t(r0 + r) * stride + blk * 64 + c * 8 : src, ok);
  }
}

/// The 1024-byte-aligned start of dynamic shared memory (the swizzle atoms' alignment; the launches
/// add 1024 bytes).
__device__ __forceinline__ bf16* align_sw128(unsigned char* smem) {
  return reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));
}

/// d [64 x 64] = A B^T over k = D (wgmma, both operands K-major in shared memory): A = 64 rows of a
/// swizzled tile of kArows rows (a: the first of them, in column block 0), B = a whole swizzled tile
/// of 64 rows. Issued, not committed. S = Q K^T, dP = dO V^T, S^T = K Q^T, dP^T = V dO^T.
template <int D, int kArows>
__device__ __forceinline__ void ss_abt(float (&d)[8][4], const bf16* a, const bf16* b) {
  // k step ks: column block ks / 4, 32 bytes per k step inside it
  const uint64_t a0 = wgmma::desc_sw128(a, 16, 1024), b0 = wgmma::desc_sw128(b, 16, 1024);
  auto da = [&](int ks) { return wgmma::desc_at(a0, ((ks / 4) * kArows * 64 + (ks % 4) * 16) * 2); };
  auto db = [&](int ks) { return wgmma::desc_at(b0, ((ks / 4) * 64 * 64 + (ks % 4) * 16) * 2); };
  wgmma::m64n64k16_ss<false>(d, da(0), db(0));
#pragma unroll
  for (int ks = 1; ks < D / 16; ++ks) wgmma::m64n64k16_ss<true>(d, da(ks), db(ks));
}

/// The A fragment (mma.sync m16n8k16 layout) of rows r0 .. r0 + 15, columns c0 .. c0 + 15 of a
/// 128-byte-swizzled tile of `rows` rows (copy_rows_sw128), one ldmatrix.x4.
__device__ __forceinline__ void load_a_sw128(uint32_t a[4], const bf16* tile, int rows, int r0, int c0, int lane) {
  const int row = r0 + (lane & 7) + 8 * ((lane >> 3) & 1), chunk = c0 / 8 + ((lane >> 4) & 1);
  const bf16* p = tile + (chunk / 8) * rows * 64 + row * 64 + ((chunk % 8) ^ (row % 8)) * 8;
  const unsigned addr = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

/// d [64 x 64] = A B^T over k = D (wgmma): A [64 x D] from registers (a[k step]: the warp's
/// fragments, load_a_sw128), B = a whole swizzled tile of 64 rows, K-major. Issued, not committed.
template <int D>
__device__ __forceinline__ void rs_abt(float (&d)[8][4], const uint32_t (*a)[4], const bf16* b) {
  const uint64_t b0 = wgmma::desc_sw128(b, 16, 1024);
  auto db = [&](int ks) { return wgmma::desc_at(b0, ((ks / 4) * 64 * 64 + (ks % 4) * 16) * 2); };
  wgmma::m64n64k16_rs<false>(d, a[0], db(0));
#pragma unroll
  for (int ks = 1; ks < D / 16; ++ks) wgmma::m64n64k16_rs<true>(d, a[ks], db(ks));
}

/// d [64 x D] += A B (wgmma, D / 128 products of n = 128): A [64 x K] from registers (a[k step]: the
/// warp's fragments of the accumulator tiles rounded to bf16, acc_to_a, built before the fence),
/// B = a swizzled tile of K rows x D, MN-major (K down its rows). Issued, not committed.
template <int K, int D = 128>
__device__ __forceinline__ void rs_ab_frags(float (&d)[D / 8][4], const uint32_t (*a)[4], const bf16* b) {
  const uint64_t b0 = wgmma::desc_sw128(b, K * 128, 1024);  // LBO = the stride between two 64-column blocks, SBO = 8 rows
#pragma unroll
  for (int h = 0; h < D / 128; ++h) {  // output columns 128 h ..: column blocks 2 h and 2 h + 1 of B
    float(&dh)[16][4] = *reinterpret_cast<float(*)[16][4]>(&d[16 * h]);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
      wgmma::m64n128k16_rs_mn(dh, a[kk], wgmma::desc_at(b0, (2 * h * K * 64 + kk * 16 * 64) * 2), true);
  }
}

/// rs_ab_frags of the accumulator tiles c [64 x K] (fragments built, then the fence). O += P V,
/// dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <int K, int D = 128>
__device__ __forceinline__ void rs_ab(float (&d)[D / 8][4], const float (*c)[4], const bf16* b) {
  uint32_t a[K / 16][4];
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) acc_to_a(a[kk], c, kk);
  wgmma::fence();
  rs_ab_frags<K, D>(d, a, b);
}

/// Shared-memory buffers of the Hopper kernels' key tiles (forward, dQ) or query items (dK / dV):
/// the forward's head_dim 128 path fetches two tiles ahead (four buffers), its head_dim 256 path keeps
/// K and V in rings of two each beside the 128 x 256 Q tile (a third K buffer would still fit, 225 KB;
/// not tried); the backward kernels fetch one tile ahead, with three.
__host__ __device__ constexpr int fwd_wgmma_bufs(bool prefetch_s) { return prefetch_s ? 4 : 2; }
constexpr int kBwdWgmmaBufs = 3;

/// Warpgroup ping-pong (FlashAttention-3, Shah et al. 2024, section 3.1) for a CTA of two
/// warpgroups: named barriers 1 and 2 order their products' issue (the score products; in the
/// head_dim 256 forward the next S and this tile's P V together), warpgroup 0 first and
/// warpgroup 1 once warpgroup 0's are queued, so that the tensor cores run one warpgroup's products
/// while the other exponentiates instead of both waiting on both. turn() before the issue, pass()
/// right after it (the barrier ids are computed, no branch around an MMA in flight), finish() once
/// after the loop (it takes warpgroup 1's last pass). Barrier 0 stays __syncthreads'.
struct PingPong {
  int wg;
  __device__ explicit PingPong(int w) : wg(w) {
    if (wg == 1) arrive(1);  // warpgroup 0 goes first
  }
  __device__ static void arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
  __device__ static void sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
  __device__ void turn() const { sync(1 + wg); }
  __device__ void pass() const { arrive(2 - wg); }
  __device__ void finish() const {
    if (wg == 0) sync(1);
  }
};

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

// ---------------------------------------------------------------------------------------------
// Backward preprocessing, one warp per (row r < Nqp, head h), head-major so that a query tile's
// statistics are contiguous: delta_t[h][r] = sum_d dO * O (fp32) and lse2_t[h][r] = lse[r][h] log2(e)
// (the exponent base of the kernels); both 0 for the padding rows r >= Nq (Nqp = Nq rounded up to BM).
template <int D>
__global__ void row_stats_kernel(const bf16* o, const bf16* dout, const float* lse, int Nq, int Nqp, int H,
                                 float* delta_t, float* lse2_t) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= int64_t(Nqp) * H) return;
  const int r = int(w / H), h = int(w % H);
  float s = 0.f;
  if (r < Nq)
    for (int c = lane; c < D; c += 32) s += __bfloat162float(o[w * D + c]) * __bfloat162float(dout[w * D + c]);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) {
    delta_t[int64_t(h) * Nqp + r] = s;
    lse2_t[int64_t(h) * Nqp + r] = r < Nq ? lse[w] * kLog2e : 0.f;
  }
}

/// Per query tile, the union of its rows' ranges (int4: ctx lo, ctx hi, blk lo, blk hi).
__global__ void tile_union_kernel(const KvRange32* ranges, int Nq, int4* out) {
  __shared__ int lohi[8];
  tile_union(ranges, Nq, blockIdx.x * BM, BM, lohi);
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = make_int4(lohi[0], lohi[1], lohi[2], lohi[3]);
    out[2 * blockIdx.x + 1] = make_int4(lohi[4], lohi[5], lohi[6], lohi[7]);
  }
}

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

// ---------------------------------------------------------------------------------------------
// Backward on Hopper (sm_90a, head_dim 128): the two kernels above with warpgroup MMAs on the
// forward's swizzled tiles (rs_abt / ss_abt for the scores, rs_ab for the products with the
// probabilities). In dQ the two score products are committed as two groups, so P's exponentials run
// while the tensor cores compute dP. (The same in dK / dV, with P^T dO in flight while dS^T is
// formed, measured 1.64 against 1.62 ms for the plain order below, and spilled registers.) Both
// kernels take turns between their warpgroups (PingPong) and keep three buffers, one barrier per
// tile or item. The tiles that stream (K / V in dQ, Q / dO in dK / dV) come through the TMA; the
// ones loaded once per CTA and the row statistics through cp.async.

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

/// dk[i] = sum over parts of part_dk[p][i] (p in order), the same for dv; n = Nk * Hkv * D.
__global__ void dkv_reduce_kernel(const float* part_dk, const float* part_dv, int parts, int64_t n, bf16* dk, bf16* dv) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float a = 0.f, b = 0.f;
    for (int p = 0; p < parts; ++p) a += part_dk[p * n + i], b += part_dv[p * n + i];
    dk[i] = __float2bfloat16_rn(a);
    dv[i] = __float2bfloat16_rn(b);
  }
}

/// Rows of the head-major row statistics: Nq rounded up to whole query tiles (BM).
int padded_rows(int64_t Nq) { return int((Nq + BM - 1) / BM * BM); }

/// Parts of the dK / dV launch: the mma.sync kernel splits in 2 once there are kSplitQueryTiles query
/// tiles or more. The wgmma kernel runs unsplit: its 128-key CTAs, one per SM, measured 1.36 ms per 8B
/// drafter layer against 1.52 + 0.07 ms split in two parts with the reduction.
constexpr int kSplitQueryTiles = 16;
int dkv_parts(int64_t Nq, bool wgmma) { return !wgmma && (Nq + BM - 1) / BM >= kSplitQueryTiles ? 2 : 1; }

void check_args(int64_t Nq, int64_t Nk, int H, int Hkv, float scale, const char* what) {
  if (Nq < 0 || Nk < 0 || Nq > INT_MAX / 2 || Nk > INT_MAX / 2 || H <= 0 || Hkv <= 0 || H % Hkv)
    throw std::invalid_argument(std::string(what) + ": bad sizes (Nq " + std::to_string(Nq) + ", Nk " +
                                std::to_string(Nk) + ", H " + std::to_string(H) + ", Hkv " + std::to_string(Hkv) + ")");
  if (!(scale > 0.f) || !std::isfinite(scale * kLog2e))  // the kernels take maxima of unscaled scores
    throw std::invalid_argument(std::string(what) + ": scale " + std::to_string(scale) + " is not a positive finite number");
}

template <typename K>
void set_smem(K kernel, size_t bytes) {
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

/// Forward tiling per head_dim: keys per tile and 16-row m-tiles per warp. head_dim 256: 32 keys, so
/// that two CTAs (8 warps) fit on an SM (4 x 32 x 264 bf16 = 68 KB of shared memory each, <= 256
/// registers); 128: two m-tiles per warp (128 query rows per CTA, 104 KB, two CTAs per SM); 64: one.
constexpr int fwd_keys(int D) { return D >= 256 ? 32 : BN; }
constexpr int fwd_mtiles(int D) { return D == 128 ? 2 : 1; }

template <int D, int W>
void launch_fwd(const bf16* q, const bf16* k, const bf16* v, const KvRange32* r, int Nq, int Nk, int H, int Hkv,
                float scale, bf16* o, float* lse, cudaStream_t s) {
  constexpr int N = fwd_keys(D), MT = fwd_mtiles(D), QR = 16 * W * MT;
  const size_t smem = size_t((MT == 2 ? QR : 0) + 4 * N) * (D + 8) * sizeof(bf16);
  set_smem(fwd_kernel<D, W, N, MT>, smem);
  fwd_kernel<D, W, N, MT><<<dim3((Nq + QR - 1) / QR, H), 32 * W, smem, s>>>(q, k, v, r, Nq, Nk, H, Hkv,
                                                                            scale * kLog2e, o, lse);
  DFLASH_CUDA_CHECK_LAUNCH();
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

/// The dQ and dK / dV launches of the Hopper kernels (head_dim 128, two warpgroups per CTA).
void launch_bwd_wgmma(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const KvRange32* r, int Nq,
                      int Nqp, int Nk, int H, int Hkv, float scale, bf16* dq, float* delta_t, float* lse2_t,
                      const int4* tiles, int parts, int qpp, bf16* dk, bf16* dv, float* pdk, float* pdv, cudaStream_t s) {
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

template <int D>
void launch_bwd(const bf16* q, const bf16* k, const bf16* v, const bf16* o, const float* lse, const bf16* dout,
                const KvRange32* r, int Nq, int Nk, int H, int Hkv, float scale, bf16* dq, bf16* dk, bf16* dv,
                float* delta_t, float* lse2_t, int4* tiles, float* partials, bool wgmma, cudaStream_t s) {
  constexpr int W = kWarps;
  const int Nqp = padded_rows(Nq);
  const int64_t rh = int64_t(Nqp) * H;
  row_stats_kernel<D><<<int((rh * 32 + 255) / 256), 256, 0, s>>>(o, dout, lse, Nq, Nqp, H, delta_t, lse2_t);
  DFLASH_CUDA_CHECK_LAUNCH();
  tile_union_kernel<<<(Nq + BM - 1) / BM, 128, 0, s>>>(r, Nq, tiles);
  DFLASH_CUDA_CHECK_LAUNCH();
  const int parts = dkv_parts(Nq, wgmma), qtiles = (Nq + BM - 1) / BM, qpp = (qtiles + parts - 1) / parts;
  float* pdk = parts > 1 ? partials : nullptr;
  float* pdv = parts > 1 ? partials + int64_t(parts) * Nk * Hkv * D : nullptr;
  if (wgmma) {
    launch_bwd_wgmma(q, k, v, dout, r, Nq, Nqp, Nk, H, Hkv, scale, dq, delta_t, lse2_t, tiles, parts, qpp, dk, dv, pdk,
                     pdv, s);
  } else {
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
  if (parts > 1) {
    const int64_t n = int64_t(Nk) * Hkv * D;
    dkv_reduce_kernel<<<int(std::min<int64_t>((n + 255) / 256, 65535 * 4)), 256, 0, s>>>(pdk, pdv, parts, n, dk, dv);
    DFLASH_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

bool masked_attention_uses_wgmma(int D) { return (D == 128 || D == 256) && runs_sm90a(); }

namespace {
bool backward_uses_wgmma(int D, AttentionKernel kernel) {
  return D == 128 && kernel == AttentionKernel::kAuto && masked_attention_uses_wgmma(D);
}
}  // namespace

void masked_attention_forward(const bf16* q, const bf16* k, const bf16* v, const KvRange32* ranges, int64_t Nq,
                              int64_t Nk, int H, int Hkv, int D, float scale, bf16* o, float* lse,
                              cudaStream_t stream, AttentionKernel kernel) {
  check_args(Nq, Nk, H, Hkv, scale, "masked_attention_forward");
  if (Nq == 0) return;
  switch (D) {
    case 64: return launch_fwd<64, kWarps>(q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
    case 128:  // (no key at all: the mma.sync kernel, which needs no TMA descriptor of K and V)
      if (kernel == AttentionKernel::kAuto && Nk > 0 && masked_attention_uses_wgmma(D))
        return launch_fwd_wgmma<128>(q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
      return launch_fwd<128, kWarps>(q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
    case 256:
      if (kernel == AttentionKernel::kAuto && Nk > 0 && masked_attention_uses_wgmma(D))
        return launch_fwd_wgmma<256>(q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
      return launch_fwd<256, 4>(q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
    default: throw std::invalid_argument("masked_attention_forward: head_dim " + std::to_string(D) + " not in {64, 128, 256}");
  }
}

namespace {
int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }
/// Bytes of the row statistics delta_t and lse2_t, [H][padded_rows(Nq)] fp32 each.
int64_t row_stats_bytes(int64_t Nq, int H) { return 2 * int64_t(H) * padded_rows(Nq) * int64_t(sizeof(float)); }
}  // namespace

int64_t masked_attention_backward_workspace_bytes(int64_t Nq, int64_t Nk, int H, int Hkv, int D,
                                                  AttentionKernel kernel) {
  const int parts = dkv_parts(Nq, backward_uses_wgmma(D, kernel));
  return row_stats_bytes(Nq, H) + align16(2 * ((Nq + BM - 1) / BM) * int64_t(sizeof(int4))) +
         (parts > 1 ? 2 * int64_t(parts) * Nk * Hkv * D * int64_t(sizeof(float)) : 0);
}

void masked_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* o, const float* lse,
                               const bf16* dout, const KvRange32* ranges, int64_t Nq, int64_t Nk, int H, int Hkv,
                               int D, float scale, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                               cudaStream_t stream, AttentionKernel kernel) {
  check_args(Nq, Nk, H, Hkv, scale, "masked_attention_backward");
  if (D != 64 && D != 128)
    throw std::invalid_argument("masked_attention_backward: head_dim " + std::to_string(D) + " not in {64, 128}");
  if (Nk > 0 && Nq == 0) {
    DFLASH_CUDA_CHECK(cudaMemsetAsync(dk, 0, size_t(Nk) * Hkv * D * sizeof(bf16), stream));
    DFLASH_CUDA_CHECK(cudaMemsetAsync(dv, 0, size_t(Nk) * Hkv * D * sizeof(bf16), stream));
  }
  if (Nq > 0 && Nk == 0) DFLASH_CUDA_CHECK(cudaMemsetAsync(dq, 0, size_t(Nq) * H * D * sizeof(bf16), stream));
  if (Nq == 0 || Nk == 0) return;
  char* ws = static_cast<char*>(workspace);
  float* delta_t = reinterpret_cast<float*>(ws);
  float* lse2_t = delta_t + int64_t(H) * padded_rows(Nq);
  int4* tiles = reinterpret_cast<int4*>(ws + row_stats_bytes(Nq, H));
  float* partials = reinterpret_cast<float*>(reinterpret_cast<char*>(tiles) + align16(2 * ((Nq + BM - 1) / BM) * int64_t(sizeof(int4))));
  const auto launch = D == 64 ? launch_bwd<64> : launch_bwd<128>;
  const bool wgmma = backward_uses_wgmma(D, kernel);
  launch(q, k, v, o, lse, dout, ranges, int(Nq), int(Nk), H, Hkv, scale, dq, dk, dv, delta_t, lse2_t, tiles, partials,
         wgmma, stream);
}

}  // namespace dflash::cuda
