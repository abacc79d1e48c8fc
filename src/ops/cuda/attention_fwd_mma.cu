// The masked attention forward on mma.sync tensor cores (FlashAttention-2's algorithm; masked_attention.h),
// at head_dim 64, 128 and 256: what A100 and Blackwell run, and Hopper with AttentionKernel::kMmaSync.
#include <stdexcept>
#include <string>

#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/attention_softmax.cuh"

namespace dflash::cuda::detail {

namespace {

// Forward: one CTA per (query tile, head); warp w owns MT 16-row m-tiles (rows 16 MT w ..
// 16 MT w + 16 MT - 1 of the tile); keys N at a time. With MT 1 the warp keeps its query fragments
// in registers (the query tile is staged in the key / value buffers); with MT 2 the query tile stays
// in shared memory and each key / value fragment loaded from shared memory serves both m-tiles
// (FlashAttention-2's layout: half the shared-memory reads per product).
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

}  // namespace

void attention_fwd_mma(int D, const bf16* q, const bf16* k, const bf16* v, const KvRange32* r, int Nq, int Nk, int H,
                       int Hkv, float scale, bf16* o, float* lse, cudaStream_t s) {
  switch (D) {
    case 64: return launch_fwd<64, kWarps>(q, k, v, r, Nq, Nk, H, Hkv, scale, o, lse, s);
    case 128: return launch_fwd<128, kWarps>(q, k, v, r, Nq, Nk, H, Hkv, scale, o, lse, s);
    case 256: return launch_fwd<256, 4>(q, k, v, r, Nq, Nk, H, Hkv, scale, o, lse, s);
    default: throw std::invalid_argument("attention_fwd_mma: head_dim " + std::to_string(D) + " not in {64, 128, 256}");
  }
}

}  // namespace dflash::cuda::detail
