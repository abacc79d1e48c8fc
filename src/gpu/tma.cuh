// Hopper's tensor memory accelerator (TMA, PTX ISA "cp.async.bulk.tensor") and the shared-memory
// barriers (mbarrier) that count its bytes, sm_90a only: one thread copies a whole tile from global
// to shared memory, 128-byte swizzled as wgmma reads it (wgmma.cuh), without per-thread address
// arithmetic; the threads that read the tile wait on the tile's mbarrier. The descriptor of the
// global tensor (CUtensorMap) is made on the host through the driver's cuTensorMapEncodeTiled,
// reached via the runtime's cudaGetDriverEntryPointByVersion (CUDA 12.5+; no link to libcuda).
// Without sm_90a every device entry point traps.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "gpu/runtime.h"
#include "gpu/wgmma.cuh"

namespace dflash::cuda::tma {

/// The descriptor of a row-major [rows, heads, D] bf16 tensor at `base` for boxes of box_rows rows x
/// 64 columns of one head, landing in shared memory as one 128-byte-swizzled [box_rows][64] block
/// (copy_rows_sw128's layout). Rows past `rows` read as zeros. rows, heads >= 1; D a multiple of 64;
/// base 16-byte aligned. Throws std::runtime_error naming `what` when the driver lacks TMA or
/// refuses the descriptor.
inline CUtensorMap rows_map(const void* base, int64_t rows, int heads, int D, int box_rows, const char* what) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (!encode) throw std::runtime_error(std::string(what) + ": the CUDA driver has no cuTensorMapEncodeTiled (TMA)");
  CUtensorMap map;
  const cuuint64_t dims[3] = {cuuint64_t(D), cuuint64_t(heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(D) * 2, cuuint64_t(heads) * cuuint64_t(D) * 2};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, 1, cuuint32_t(box_rows)}, elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuTensorMapEncodeTiled failed (error " + std::to_string(int(r)) +
                             ") for a [" + std::to_string(rows) + ", " + std::to_string(heads) + ", " +
                             std::to_string(D) + "] bf16 tensor (its start must be 16-byte aligned)");
  return map;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

/// A ring of n buffers with one mbarrier each: use j of the ring fills buffer j % n, and is phase
/// j / n of that buffer's barrier. init_ring: one thread readies the barriers (one arrival per phase,
/// visible to the TMA unit); a __syncthreads must follow before any other thread waits on one.
__device__ __forceinline__ void init_ring(uint64_t* bars, int n) {
#if DFLASH_WGMMA_ON
  for (int b = 0; b < n; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bars + b)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();
#endif
}

/// Arrives on `bar` (its one arrival of the phase) announcing `bytes` that copies will bring.
__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
#if DFLASH_WGMMA_ON
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#else
  __trap();
#endif
}

/// Waits until the phase of `bar` with this parity (0 for its 1st, 3rd, ... phases) has completed;
/// the copies counted in it are then visible to the calling thread.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
#if DFLASH_WGMMA_ON
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}

/// Waits until use j of a ring of n buffers (init_ring) has landed.
__device__ __forceinline__ void wait_ring(uint64_t* bars, int n, int j) { wait(&bars[j % n], (j / n) & 1); }

/// Copies the box at coordinates (c0 column, c1 head, c2 row) of `map` to `dst` (1024-byte aligned)
/// and counts its bytes on `bar`.
__device__ __forceinline__ void load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
#if DFLASH_WGMMA_ON
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#else
  __trap();
#endif
}

/// Rows row0 .. row0 + R - 1 of one head of a [rows, heads, D] tensor into `a` as D / 64 swizzled
/// [R][64] blocks (copy_rows_sw128's layout), counted on `full` (one phase). One thread calls it; m:
/// rows_map with box_rows R.
template <int R, int D>
__device__ __forceinline__ void load_tile(bf16* a, const CUtensorMap* m, uint64_t* full, int head, int row0) {
  expect_bytes(full, R * D * sizeof(bf16));
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk) load_3d(a + blk * R * 64, m, full, 64 * blk, head, row0);
}

/// Rows row0 .. row0 + R - 1 of one head of two [rows, heads, D] tensors (K and V, or Q and dO)
/// into `a` and `b`, each as D / 64 swizzled [R][64] blocks (copy_rows_sw128's layout), counted on
/// `full` (one phase). One thread calls it; ma / mb: rows_map with box_rows R.
template <int R, int D>
__device__ __forceinline__ void load_tile_pair(bf16* a, bf16* b, const CUtensorMap* ma, const CUtensorMap* mb,
                                               uint64_t* full, int head, int row0) {
  expect_bytes(full, 2 * R * D * sizeof(bf16));
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk) {
    load_3d(a + blk * R * 64, ma, full, 64 * blk, head, row0);
    load_3d(b + blk * R * 64, mb, full, 64 * blk, head, row0);
  }
}

}  // namespace dflash::cuda::tma
