// The masked attention's kernels by direction and family, each launched alone: forward on mma.sync
// (attention_fwd_mma.cu) and warpgroup MMAs (attention_fwd_wgmma.cu), backward on mma.sync
// (attention_bwd_mma.cu) and warpgroup MMAs (attention_bwd_wgmma.cu), the backward's row statistics,
// tile table and dK / dV reduction (attention_bwd_stats.cu); attention_dispatch.cu picks them behind
// masked_attention.h. Internal. Shapes as masked_attention.h's: q, o, dout, dq [Nq, H, D], k, v, dk,
// dv [Nk, Hkv, D] bf16, ranges [Nq]; the backward's row statistics delta_t and lse2_t [H, Nqp] fp32
// (Nqp = Nq rounded up to BM) and tile table tiles [2 ceil(Nq / BM)] int4 (union, then intersection of
// each query tile's ranges).
#pragma once
#include <cstdint>

#include "gpu/runtime.h"
#include "ops/cuda/masked_attention.h"

namespace dflash::cuda::detail {

// Tiles: the dQ kernel gives each of its W warps 16 query rows (16 W rows per CTA), the forward 16 or
// 32 (fwd_mtiles), and both walk keys 64 at a time (32 at head_dim 256 in the forward); the dK/dV
// kernel gives each warp 16 keys and walks queries 64 at a time.
constexpr int BM = 64;  // query rows per tile in the dK / dV kernel (and in its tile table)
constexpr int BN = 64;  // keys per tile in the dQ kernel and the forward's default (fwd_keys)
constexpr int kWarps = 4;

/// The mma.sync forward at head_dim D (64, 128, 256): o and, when non-null, lse [Nq, H] fp32.
void attention_fwd_mma(int D, const bf16* q, const bf16* k, const bf16* v, const KvRange32* r, int Nq, int Nk, int H,
                       int Hkv, float scale, bf16* o, float* lse, cudaStream_t s);
/// The warpgroup-MMA forward (sm_90a code, head_dim D 128 or 256, Nk > 0): the same outputs.
void attention_fwd_wgmma(int D, const bf16* q, const bf16* k, const bf16* v, const KvRange32* r, int Nq, int Nk, int H,
                         int Hkv, float scale, bf16* o, float* lse, cudaStream_t s);

/// The backward's preprocessing at head_dim D (64, 128): delta_t = rowsum(dO * O), lse2_t = lse
/// log2(e) (zeros for the padding rows) and the tile table.
void attention_bwd_stats(int D, const bf16* o, const bf16* dout, const float* lse, const KvRange32* r, int Nq, int Nqp,
                         int H, float* delta_t, float* lse2_t, int4* tiles, cudaStream_t s);
/// The mma.sync dQ and dK / dV kernels at head_dim D (64, 128): dq, and dk / dv (bf16) or, with
/// parts > 1, the parts' fp32 partial sums pdk / pdv [parts, Nk, Hkv, D] (query tiles [p qpp, (p + 1)
/// qpp) in part p).
void attention_bwd_mma(int D, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const KvRange32* r,
                       int Nq, int Nqp, int Nk, int H, int Hkv, float scale, bf16* dq, float* delta_t, float* lse2_t,
                       const int4* tiles, int parts, int qpp, bf16* dk, bf16* dv, float* pdk, float* pdv,
                       cudaStream_t s);
/// The warpgroup-MMA dQ and dK / dV kernels (sm_90a code, head_dim 128): as attention_bwd_mma.
void attention_bwd_wgmma(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const KvRange32* r, int Nq,
                         int Nqp, int Nk, int H, int Hkv, float scale, bf16* dq, float* delta_t, float* lse2_t,
                         const int4* tiles, int parts, int qpp, bf16* dk, bf16* dv, float* pdk, float* pdv,
                         cudaStream_t s);
/// dk[i], dv[i] (bf16) = the sums over parts of pdk[p][i], pdv[p][i] in part order, n = Nk Hkv D.
void attention_dkv_reduce(const float* pdk, const float* pdv, int parts, int64_t n, bf16* dk, bf16* dv,
                          cudaStream_t s);

}  // namespace dflash::cuda::detail
