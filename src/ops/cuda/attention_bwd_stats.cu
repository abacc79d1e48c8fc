// The masked attention backward's small kernels (masked_attention.h), for both kernel families: the
// row statistics and the query tiles' range table before dQ and dK / dV, and the reduction of a split
// dK / dV launch's partial sums after.
#include <algorithm>

#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_kernels.h"

namespace dflash::cuda::detail {

namespace {

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

/// dk[i] = sum over parts of part_dk[p][i] (p in order), the same for dv; n = Nk * Hkv * D.
__global__ void dkv_reduce_kernel(const float* part_dk, const float* part_dv, int parts, int64_t n, bf16* dk, bf16* dv) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float a = 0.f, b = 0.f;
    for (int p = 0; p < parts; ++p) a += part_dk[p * n + i], b += part_dv[p * n + i];
    dk[i] = __float2bfloat16_rn(a);
    dv[i] = __float2bfloat16_rn(b);
  }
}

}  // namespace

void attention_bwd_stats(int D, const bf16* o, const bf16* dout, const float* lse, const KvRange32* r, int Nq, int Nqp,
                         int H, float* delta_t, float* lse2_t, int4* tiles, cudaStream_t s) {
  const int64_t rh = int64_t(Nqp) * H;
  const auto row_stats = D == 64 ? row_stats_kernel<64> : row_stats_kernel<128>;
  row_stats<<<int((rh * 32 + 255) / 256), 256, 0, s>>>(o, dout, lse, Nq, Nqp, H, delta_t, lse2_t);
  DFLASH_CUDA_CHECK_LAUNCH();
  tile_union_kernel<<<(Nq + BM - 1) / BM, 128, 0, s>>>(r, Nq, tiles);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void attention_dkv_reduce(const float* pdk, const float* pdv, int parts, int64_t n, bf16* dk, bf16* dv,
                          cudaStream_t s) {
  dkv_reduce_kernel<<<int(std::min<int64_t>((n + 255) / 256, 65535 * 4)), 256, 0, s>>>(pdk, pdv, parts, n, dk, dv);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda::detail
