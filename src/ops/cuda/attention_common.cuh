// Device helpers shared by the masked attention kernels (attention_*.cu; masked_attention.h): the
// mma.sync fragment products, range visibility, cp.async row copies, the key-tile pipeline and each
// query tile's union / intersection of ranges.
#pragma once
#include <climits>

#include "gpu/fast_math.cuh"
#include "gpu/mma.cuh"
#include "ops/cuda/attention_kernels.h"

namespace dflash::cuda::detail {

using namespace mma;

// Tiles: the dQ kernel gives each of its W warps 16 query rows (16 W rows per CTA), the forward 16 or
// 32 (fwd_mtiles), and both walk keys 64 at a time (32 at head_dim 256 in the forward); the dK/dV
// kernel gives each warp 16 keys and walks queries 64 at a time.
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
inline __device__ void tile_union(const KvRange32* ranges, int Nq, int row0, int rows, int* lohi) {
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

/// Lets `kernel` use `bytes` of dynamic shared memory.
template <typename K>
void set_smem(K kernel, size_t bytes) {
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace dflash::cuda::detail
