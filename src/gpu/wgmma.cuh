// Hopper warpgroup MMAs (wgmma.mma_async, PTX ISA "Asynchronous Warpgroup Level Matrix Multiply"),
// sm_90a only: a warpgroup (4 consecutive warps, the first one's index divisible by 4) multiplies a
// 64-row A (shared memory or registers) by a B in shared memory, fp32 accumulators in registers.
//
// Shared-memory operands use the 128-byte swizzle (the no-swizzle layout measured 1.5x slower in
// the attention forward): a [rows][64 bf16] block stores row r at r 128 bytes with its 16-byte chunk c
// at (c ^ r % 8) 16, in 1024-byte-aligned atoms of 8 rows. A descriptor gives the start address, LBO
// and SBO. K-major operands (K along the row: Q, K): SBO 1024 (8 rows), LBO unused, one k step of 16
// = 32 bytes further inside the block, the next 64 columns in the next block. MN-major operands (K
// down the rows: V in P V; as A, M along the rows: K^T in gdn_chunk_state_wgmma.cu's chunk_state): SBO 1024
// (8 rows along K), LBO the stride between 64-column blocks along M / N, one k step = 16 rows further.
// Both checked against CPU references on the H200.
//
// Accumulator layout of m64nNk16 (per warp w of the warpgroup, rows 16 w .. 16 w + 15; g = lane / 4,
// t = lane % 4): d[n8][0..1] = (g, 8 n8 + 2t ..), d[n8][2..3] = (g + 8, 8 n8 + 2t ..), the mma.sync
// m16n8k16 C layout per n-tile. A from registers: the mma.sync m16n8k16 A fragment of the warp's rows.
// Without sm_90a (other targets, or sm_90 without the "a" features) every entry point traps.
#pragma once
#include <cstdint>

namespace dflash::cuda::wgmma {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DFLASH_WGMMA_ON 1
#else
#define DFLASH_WGMMA_ON 0
#endif

/// Descriptor of a shared-memory operand at `smem` without swizzle (16-byte aligned); lbo, sbo in bytes.
__device__ __forceinline__ uint64_t desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return uint64_t((a >> 4) & 0x3FFF) | uint64_t((lbo >> 4) & 0x3FFF) << 16 | uint64_t((sbo >> 4) & 0x3FFF) << 32;
}

/// desc() of a 128-byte-swizzled operand (layout type 1; its atoms 1024-byte aligned).
__device__ __forceinline__ uint64_t desc_sw128(const void* smem, uint32_t lbo, uint32_t sbo) {
  return desc(smem, lbo, sbo) | (uint64_t(1) << 62);
}

/// The descriptor `d` with its start address advanced by `bytes` (a multiple of 16, inside the same
/// operand): one 32-bit add. The address field (16-byte units, bits 0-13) holds every shared-memory
/// address (< 228 KB < 2^18 bytes), so the add never carries into LBO. A kernel computes an operand's
/// desc_sw128 once and each k step's descriptor from it, instead of the address conversion and field
/// packing per wgmma (~8 instructions each; most of the head_dim 256 attention forward's ~320 integer
/// instructions of 715 per warp and key tile).
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4));
}

/// Orders this thread's earlier register writes before the next wgmma (wgmma.fence).
__device__ __forceinline__ void fence() {
#if DFLASH_WGMMA_ON
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

/// Commits the wgmmas issued since the last commit as one group (possibly empty).
__device__ __forceinline__ void commit() {
#if DFLASH_WGMMA_ON
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

/// Waits until at most N committed groups are in flight (groups complete in commit order).
template <int N>
__device__ __forceinline__ void wait() {
#if DFLASH_WGMMA_ON
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}

/// Makes this thread's ordinary shared-memory writes (stores, cp.async) visible to the async proxy
/// that wgmma reads through; then a barrier, before the wgmma.
__device__ __forceinline__ void fence_proxy_async() {
#if DFLASH_WGMMA_ON
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  __trap();
#endif
}

#define DFLASH_ACC8(d)                                                                                               \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),       \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),   \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),   \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),   \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define DFLASH_OUT8(d)                                                                                               \
  "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]),       \
      "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]),   \
      "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]),   \
      "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]),   \
      "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3])
#define DFLASH_M64N64_D "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

/// d [64 x 64] (+)= A B^T over one k step of 16: A [64 x 16] and B [64 x 16] in shared memory
/// (descriptors da, db), K-major, or MN-major where kTransA / kTransB is 1 (then A [16 x 64] with M
/// along its rows, B [16 x 64] with N along them: d += A^T B). kAccumulate = false overwrites d
/// through write-only operands (the compiler then neither reads nor keeps d's earlier values).
template <bool kAccumulate, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void m64n64k16_ss(float (&d)[8][4], uint64_t da, uint64_t db) {
#if DFLASH_WGMMA_ON
#define DFLASH_ASM                                                                                           \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DFLASH_M64N64_D \
  ", %32, %33, p, 1, 1, %35, %36;\n}\n"
  if constexpr (kAccumulate)
    asm volatile(DFLASH_ASM : DFLASH_ACC8(d) : "l"(da), "l"(db), "n"(1), "n"(kTransA), "n"(kTransB));
  else
    asm volatile(DFLASH_ASM : DFLASH_OUT8(d) : "l"(da), "l"(db), "n"(0), "n"(kTransA), "n"(kTransB));
#undef DFLASH_ASM
#else
  __trap();
#endif
}

/// d [64 x 64] (+)= A B^T over one k step of 16: A [64 x 16] from registers (a: the warp's mma.sync A
/// fragment), B [64 x 16] K-major in shared memory (descriptor db). kAccumulate as m64n64k16_ss.
template <bool kAccumulate>
__device__ __forceinline__ void m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
#if DFLASH_WGMMA_ON
#define DFLASH_ASM                                                                                           \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DFLASH_M64N64_D \
  ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
  if constexpr (kAccumulate)
    asm volatile(DFLASH_ASM : DFLASH_ACC8(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
  else
    asm volatile(DFLASH_ASM : DFLASH_OUT8(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(0));
#undef DFLASH_ASM
#else
  __trap();
#endif
}

/// d [64 x 128] (+)= A B over one k step of 16: A [64 x 16] from registers (a: the warp's mma.sync A
/// fragment), B [16 x 128] MN-major in shared memory (descriptor db).
__device__ __forceinline__ void m64n128k16_rs_mn(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, bool accumulate) {
#if DFLASH_WGMMA_ON
  float(&lo)[8][4] = *reinterpret_cast<float(*)[8][4]>(&d[0]);
  float(&hi)[8][4] = *reinterpret_cast<float(*)[8][4]>(&d[8]);
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : DFLASH_ACC8(lo), DFLASH_ACC8(hi)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(int(accumulate)));
#else
  __trap();
#endif
}

#undef DFLASH_ACC8
#undef DFLASH_OUT8
#undef DFLASH_M64N64_D

}  // namespace dflash::cuda::wgmma
