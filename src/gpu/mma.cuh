// Tensor-core building blocks shared by the hand-written kernels (sm_80+): mma.sync m16n8k16 with
// bf16 inputs and fp32 accumulation, ldmatrix fragment loads from shared memory, cp.async copies.
// Fragment layout of mma.sync m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane l holds,
// with g = l / 4 and t = l % 4,
//   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, k x n):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8):             c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace dflash::cuda::mma {

using bf16 = __nv_bfloat16;

/// c += A B (one m16n8k16 tile).
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// fp32 values x0, x1 as bf16 pairs hi and lo (x0 in the low halves, as pack()) with x ~ hi + lo to
/// about 2^-17 relative: hi = bf16(x), lo = bf16(x - hi) (x - hi is exact in fp32).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

/// c += A B with A = Ah + Al, B = Bh + Bl split by split_bf16x2 ("3xBF16", m16n8k16): c += Al Bh +
/// Ah Bl + Ah Bh, small terms first (the Al Bl term, ~2^-18 relative, is dropped). About 2^-16
/// relative per product at worst (bf16 alone: 2^-9); half the mma instructions of 3xTF32 (m16n8k8
/// tf32, ~2^-22) for the same K.
__device__ __forceinline__ void mma_3xbf16(float c[4], const uint32_t ah[4], const uint32_t al[4], uint32_t bh0,
                                           uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma16816(c, al, bh0, bh1);
  mma16816(c, ah, bl0, bl1);
  mma16816(c, ah, bh0, bh1);
}

/// mma_3xbf16 with the small terms in their own accumulator: c_lo += Al Bh + Ah Bl, c += Ah Bh (the
/// product is c + c_lo). Per k step the chains of dependent mma are 2 and 1 long instead of 3.
__device__ __forceinline__ void mma_3xbf16(float c[4], float c_lo[4], const uint32_t ah[4], const uint32_t al[4],
                                           uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma16816(c_lo, al, bh0, bh1);
  mma16816(c, ah, bh0, bh1);
  mma16816(c_lo, ah, bl0, bl1);
}

/// Two floats rounded to a bf16 pair (lo in the low half).
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

/// ldmatrix.x4 of the 16 x 16 b16 tile m[r0 .. r0 + 15][c0 .. c0 + 15] (shared memory, row-major, ld,
/// rows 16-byte aligned) as four 8 x 8 matrices into r[0..3], in the order (r0, c0), (r0 + 8, c0),
/// (r0, c0 + 8), (r0 + 8, c0 + 8), or with kColsFirst (r0, c0), (r0, c0 + 8), (r0 + 8, c0),
/// (r0 + 8, c0 + 8); each matrix transposed with kTrans.
template <bool kColsFirst, bool kTrans>
__device__ __forceinline__ void ldmatrix_tile(uint32_t r[4], const bf16* m, int ld, int r0, int c0, int lane) {
  const int first = (lane >> 3) & 1, second = (lane >> 4) & 1;  // lanes 8 i .. 8 i + 7 address matrix i
  const int row = r0 + (lane & 7) + 8 * (kColsFirst ? second : first), col = c0 + 8 * (kColsFirst ? first : second);
  const unsigned addr = unsigned(__cvta_generic_to_shared(m + row * ld + col));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/// The A fragment at (row0, col0) of a row-major smem matrix (leading dimension ld, rows 16-byte
/// aligned), one ldmatrix.x4.
__device__ __forceinline__ void load_a_x4(uint32_t a[4], const bf16* m, int ld, int row0, int col0, int lane) {
  ldmatrix_tile<false, false>(a, m, ld, row0, col0, lane);
}

/// The A fragment where A[m][k] = m[k0 + k][m0 + m] (the matrix stored transposed, row-major, ld,
/// rows 16-byte aligned), one ldmatrix.x4.trans.
__device__ __forceinline__ void load_a_trans_x4(uint32_t a[4], const bf16* m, int ld, int k0, int m0, int lane) {
  ldmatrix_tile<true, true>(a, m, ld, k0, m0, lane);
}

/// B fragments of two n-tiles at once: B[k][n] = m[n0 + n][k0 + k] for n-tiles n0 (b[0], b[1]) and
/// n0 + 8 (b[2], b[3]) (m row-major, ld, rows 16-byte aligned), one ldmatrix.x4.
__device__ __forceinline__ void load_b_x4(uint32_t b[4], const bf16* m, int ld, int n0, int k0, int lane) {
  ldmatrix_tile<true, false>(b, m, ld, n0, k0, lane);
}

/// B fragments of two n-tiles where B[k][n] = m[k0 + k][n0 + n]: n-tile n0 (b[0], b[1]) and n0 + 8
/// (b[2], b[3]), transposed by ldmatrix.x4.trans.
__device__ __forceinline__ void load_b_trans_x4(uint32_t b[4], const bf16* m, int ld, int k0, int n0, int lane) {
  ldmatrix_tile<false, true>(b, m, ld, k0, n0, lane);
}

/// One k step (16) of a warp's acc += A B in 3xBF16 on split bf16 operands in shared memory: A rows
/// m0 .. m0 + 15 x columns k0 .. k0 + 15 of a row-major matrix a (with kTransA stored transposed,
/// A[m][k] = a[k][m]), its low part a_lo elements on; B rows k0 .. k0 + 15 x columns n0 .. n0 +
/// 16 kPairs - 1 of a row-major matrix b, low part b_lo on. acc gets the Ah Bh terms, lo the small ones.
template <int kPairs, bool kTransA = false>
__device__ __forceinline__ void mma_step_3xbf16(float (&acc)[2 * kPairs][4], float (&lo)[2 * kPairs][4], const bf16* a,
                                                int lda, int a_lo, int m0, const bf16* b, int ldb, int b_lo, int n0,
                                                int k0, int lane) {
  uint32_t ah[4], al[4];
  if constexpr (kTransA) {
    load_a_trans_x4(ah, a, lda, k0, m0, lane);
    load_a_trans_x4(al, a + a_lo, lda, k0, m0, lane);
  } else {
    load_a_x4(ah, a, lda, m0, k0, lane);
    load_a_x4(al, a + a_lo, lda, m0, k0, lane);
  }
#pragma unroll
  for (int np = 0; np < kPairs; ++np) {
    uint32_t bh[4], bl[4];
    load_b_trans_x4(bh, b, ldb, k0, n0 + 16 * np, lane);
    load_b_trans_x4(bl, b + b_lo, ldb, k0, n0 + 16 * np, lane);
    mma_3xbf16(acc[2 * np], lo[2 * np], ah, al, bh[0], bh[1], bl[0], bl[1]);
    mma_3xbf16(acc[2 * np + 1], lo[2 * np + 1], ah, al, bh[2], bh[3], bl[2], bl[3]);
  }
}

// cp.async: 16-byte global -> shared copies that complete in the background (zero-filled when !valid).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
/// 8-byte cp.async (through L1); zero-fills when !valid.
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 8 : 0));
}
/// 4-byte cp.async (through L1); zero-fills when !valid.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/// Waits until at most N committed groups (the newest) are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace dflash::cuda::mma
