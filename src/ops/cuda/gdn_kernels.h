// The stages of cuda::gated_delta_rule_chunked (ops/cuda/gated_delta_rule.h), each launched alone:
// chunk_prepare (gdn_chunk_prepare.cu), chunk_state in three forms (gdn_chunk_state_simt.cu,
// gdn_chunk_state_mma.cu, gdn_chunk_state_wgmma.cu) and chunk_out (gdn_chunk_out.cu), driven by
// gdn_dispatch.cu. Internal: the public API is gated_delta_rule.h; the GPU tests run the stages one by one
// against cpu::gated_delta_rule_chunked's intermediates. Plain C++ (the tests include it); the math
// of each stage is in the comment at the top of gdn_common.cuh.
//
// Layouts of the intermediates (PyTorch order; dkp = state_rows(dk), dv8 = value_cols(dv); a Split
// is one fp32 tensor as two bf16 tensors of its shape, x ~ hi + lo):
//   G    [T, Hv] fp32           the in-chunk cumulative log decays
//   w    [T, Hv, dk] fp32 (SIMT chunk_state) or w_s [T, Hv, dkp] Split (tensor-core ones)
//   k_s  [T, Hk, dkp] Split     the keys (tensor-core chunk_state); q_s the same for the queries
//   u    [T, Hv, dv] fp32       T diag(beta) V
//   P_s  [chunks, Hv, 64, 64] Split   the in-chunk decayed Q K^T (lower triangle)
//   H_s  [chunks, Hv, dkp, dv8] Split the state before each chunk
//   U_s  [T, Hv, dv8] Split     U = u - w S0
// Columns (rows) past dk or dv of the padded ones hold zeros where the products read them (see
// gdn_dispatch.cu: the caller zeroes what no kernel writes).
#pragma once
#include <cstddef>
#include <cstdint>

#include "gpu/runtime.h"
#include "ops/cuda/gated_delta_rule.h"

#ifdef __CUDACC__
#define DFLASH_GDN_HOST_DEVICE __host__ __device__
#else
#define DFLASH_GDN_HOST_DEVICE
#endif

namespace dflash::cuda::detail {

constexpr int kChunk = 64;     // tokens per chunk
constexpr int kMaxCols = 64;   // state columns (value features) per chunk_state block: 32 or 64
constexpr int kSimtCols = 32;  // state columns per block of the SIMT chunk_state
constexpr int kThreads = 256;  // threads per block of every chunked kernel

/// Padded key dim of the split operands (whole 16-row tiles of the 3xBF16 products; padding zero).
DFLASH_GDN_HOST_DEVICE constexpr int state_rows(int dk) { return (dk + 15) / 16 * 16; }
/// Padded value dim of the split H and U (16-byte rows).
DFLASH_GDN_HOST_DEVICE constexpr int value_cols(int dv) { return (dv + 7) / 8 * 8; }

/// fp32 values kept as two bf16 buffers of the same shape, x ~ hi + lo (mma::split_bf16x2: hi the
/// rounded value, lo the rounded rest): the operands of the 3xBF16 products, split once by the
/// kernel that makes them.
struct Split {
  bf16* hi;
  bf16* lo;
};

/// Shared memory one block of the current device may opt in to, in bytes.
size_t device_shared_limit();
/// Lets `kernel` use `bytes` of dynamic shared memory; a device offering less is refused with the
/// numbers (std::runtime_error naming `what`). (The attribute is per kernel and device: callers on
/// one device with other head dims would race on it, which a process serving one target never does.)
void allow_shared_memory(const void* kernel, size_t bytes, const char* what);

/// Shared memory (bytes) of chunk_prepare for r = Hv / Hk value heads per key head and conv kernel
/// size conv_k (0: no conv inside).
size_t chunk_prepare_smem(int dk, int dv, int r, int conv_k);
/// chunk_prepare over the nch chunks of `chunks` (device [nch]): one block per (chunk, key head)
/// writes G, u, P_s and q_s, and w to w_out (fp32, for the SIMT chunk_state) or, with w_out null,
/// w_s and k_s (for the tensor-core ones). conv_k 0: q, k [T, Hk, dk], v (token rows v_stride
/// floats apart, 0: Hv dv), g, beta [T, Hv] fp32 are read; conv_k 4: the projections pj instead
/// (GdnProjections, gdn_projections_fuse). prepared (null: none) [nch Hk + 1] int, zeroed: each
/// block's flag and their count, for a chunk_state launched beside it. Throws std::runtime_error
/// when the device lacks the shared memory, std::invalid_argument for conv_k other than 0 or 4.
void launch_chunk_prepare(int conv_k, const float* q, const float* k, const float* v, const float* g,
                          const float* beta, const GdnChunk* chunks, int64_t nch, int Hk, int Hv, int dk, int dv,
                          float* w_out, Split w_s, Split k_s, Split q_s, float* u_out, Split P_s, float* G_out,
                          int64_t v_stride, const GdnProjections& pj, int* prepared, cudaStream_t stream);

/// The operands of every chunk_state form: the chunks of nseq sequences (chunks [count], first
/// [nseq + 1], GdnChunkPlan's), their w and keys (fp32 w, k for the SIMT form; w_s, k_s Split for
/// the tensor-core ones), u and G; init (null: zeros) and final_state (null: not written)
/// [nseq, Hv, dk, dv] fp32; out: H_s and U_s. progress (null: none) [nseq, Hv, column blocks] int,
/// zeroed: each block's chunks done, for a chunk_out launched beside it; prepared (null: none) and
/// prep_blocks: chunk_prepare's flags, when launched beside it (tensor-core forms only).
struct ChunkStateArgs {
  const float* k = nullptr;
  const float* w = nullptr;
  Split k_s{}, w_s{};
  const float* u = nullptr;
  const float* G = nullptr;
  const GdnChunk* chunks = nullptr;
  const int32_t* first = nullptr;
  int nseq = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;
  const float* init = nullptr;
  float* final_state = nullptr;
  Split H_s{}, U_s{};
  int* progress = nullptr;
  const int* prepared = nullptr;
  int prep_blocks = 0;
};

/// Shared memory (bytes) of the SIMT chunk_state at key dim dk.
size_t chunk_state_simt_smem(int dk);
/// The SIMT chunk_state: grid (nseq, Hv, ceil(dv / kSimtCols)). Throws std::runtime_error when the
/// device lacks the shared memory.
void launch_chunk_state_simt(const ChunkStateArgs& a, cudaStream_t stream);

/// Shared memory (bytes) of the mma.sync chunk_state at key dim dk with cols (32 or 64) state columns.
size_t chunk_state_mma_smem(int dk, int cols);
/// The mma.sync chunk_state with cols (32 or 64) state columns per block: grid (nseq, Hv,
/// ceil(dv / cols)); `programmatic`: a programmatic dependent launch (beside chunk_prepare). Throws
/// std::invalid_argument for other cols, std::runtime_error when the device lacks the shared memory.
void launch_chunk_state_mma(int cols, const ChunkStateArgs& a, bool programmatic, cudaStream_t stream);

/// Shared memory (bytes) of the warpgroup-MMA chunk_state (dkp 128, 64 state columns per block).
size_t chunk_state_wgmma_smem();
/// The warpgroup-MMA chunk_state (sm_90a code; state_rows(dk) == 128): grid (nseq, Hv, ceil(dv /
/// 64)); `programmatic` as launch_chunk_state_mma's.
void launch_chunk_state_wgmma(const ChunkStateArgs& a, bool programmatic, cudaStream_t stream);

/// Shared memory (bytes) of chunk_out at key dim dk.
size_t chunk_out_smem(int dk);
/// chunk_out over the nch chunks of `chunks`: one block per (chunk, value head) writes o [T, Hv, dv]
/// fp32, or with norm (GatedNormOut) the normed rows to norm->y. progress (null: none) and
/// col_blocks: chunk_state's flags, when launched beside it; prepared / prep_blocks: chunk_prepare's.
/// `programmatic`: a programmatic dependent launch (beside chunk_state).
void launch_chunk_out(const GatedNormOut* norm, Split q_s, Split H_s, Split U_s, Split P_s, const float* G,
                      const GdnChunk* chunks, int64_t nch, int Hk, int Hv, int dk, int dv, float* o,
                      const int* progress, int col_blocks, const int* prepared, int prep_blocks, bool programmatic,
                      cudaStream_t stream);

}  // namespace dflash::cuda::detail
