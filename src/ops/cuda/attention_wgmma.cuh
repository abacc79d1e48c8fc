// Hopper helpers of the masked attention (sm_90a): swizzled tiles, warpgroup-MMA products and the
// warpgroups' turns, shared by attention_fwd_wgmma.cu and attention_bwd_wgmma.cu.
#pragma once
#include "gpu/tma.cuh"
#include "gpu/wgmma.cuh"
#include "ops/cuda/attention_common.cuh"

namespace dflash::cuda::detail {

using namespace mma;

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

}  // namespace dflash::cuda::detail
