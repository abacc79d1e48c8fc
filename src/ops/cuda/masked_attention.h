// Block-sparse masked attention on the GPU, forward and backward: the DFlash drafter's attention
// (context prefix / window up to each anchor + own block) and, with causal ranges, the targets'
// causal varlen attention. Reference: src/ops/cpu/dflash_attention.cpp (masked_attention_forward /
// masked_attention_backward); algorithm: FlashAttention-2 (Dao, 2023) with bf16 tensor-core MMAs
// (mma.sync m16n8k16; at head_dim 128 on H100 / H200 forward and backward use Hopper's wgmma instead, see
// AttentionKernel), online softmax in fp32, tiles of 64 queries x 64 keys, and key tiles outside
// every row's ranges skipped.
#pragma once
#include <cstdint>
#include <vector>

#include "gpu/runtime.h"

namespace dflash::cpu {
struct KvRanges;
}

namespace dflash::cuda {

/// One query row's visible keys: [ctx_begin, ctx_end) U [blk_begin, blk_end) (as cpu::KvRanges).
struct KvRange32 {
  int32_t ctx_begin = 0, ctx_end = 0, blk_begin = 0, blk_end = 0;
};

/// Host conversion of cpu::KvRanges (checked to fit int32; throws std::invalid_argument).
/// (masked_attention_ranges.cpp, compiled as C++20 with the rest of the host code.)
std::vector<KvRange32> to_kv_range32(const std::vector<cpu::KvRanges>& r);

/// Causal varlen ranges for a packed batch (cu_seqlens [n + 1]): row t of sequence [s0, s1) sees
/// [s0, t] (ctx range), no second range. What the target's attention needs.
std::vector<KvRange32> causal_ranges(const std::vector<int64_t>& cu_seqlens);

/// Kernel family of the forward and backward. kAuto: warpgroup MMAs (wgmma: fwd_wgmma_kernel at
/// head_dim 128 and 256, dq_wgmma_kernel and dkv_wgmma_kernel at 128) on a compute capability 9.0 GPU
/// (H100 / H200) when the build carries sm_90a code, else mma.sync; kMmaSync: mma.sync everywhere (what A100 and
/// Blackwell run; the tests compare the two).
enum class AttentionKernel { kAuto, kMmaSync };

/// Whether masked_attention_forward (and at head_dim 128 _backward) with kAuto run wgmma at head_dim D
/// on the current device (false without a usable device; never throws).
bool masked_attention_uses_wgmma(int D);

/// Forward. q [Nq, H, D], k and v [Nk, Hkv, D] bf16 (H % Hkv == 0, query head h uses kv head
/// h / (H / Hkv)), ranges [Nq] (device). Writes o [Nq, H, D] bf16 (0 for a row that sees nothing)
/// and, when non-null, lse [Nq, H] fp32 = natural-log logsumexp of the scaled allowed scores
/// (-inf for a row that sees nothing). D in {64, 128, 256}, scale > 0 (finite); throws
/// std::invalid_argument otherwise. q, k, v, o 16-byte aligned; on Hopper, std::runtime_error when the
/// driver refuses the TMA descriptor of k or v (tma.cuh).
void masked_attention_forward(const bf16* q, const bf16* k, const bf16* v, const KvRange32* ranges, int64_t Nq,
                              int64_t Nk, int H, int Hkv, int D, float scale, bf16* o, float* lse,
                              cudaStream_t stream, AttentionKernel kernel = AttentionKernel::kAuto);

/// Bytes of workspace masked_attention_backward with the same `kernel` needs: each row's delta and
/// lse, head-major (2 x H x Nq rounded up to 64 floats), a table of the query tiles' key ranges and,
/// for long query sets on the mma.sync kernels, the fp32 partial dK / dV sums of a split launch
/// (2 parts x 2 x Nk x Hkv x D floats). kMmaSync's size serves both families. The workspace must be
/// 16-byte aligned.
int64_t masked_attention_backward_workspace_bytes(int64_t Nq, int64_t Nk, int H, int Hkv, int D,
                                                  AttentionKernel kernel = AttentionKernel::kAuto);

/// Backward: given the forward's inputs, o, lse and dout [Nq, H, D], writes dq [Nq, H, D] and
/// dk, dv [Nk, Hkv, D] (bf16, overwritten; fp32 accumulation inside). Deterministic (no atomics):
/// one kernel computes dK / dV per key tile over the query heads of its kv head, another dQ per
/// query tile. D in {64, 128}, scale > 0 (finite); throws std::invalid_argument otherwise. All tensors
/// 16-byte aligned; on Hopper, std::runtime_error when the driver refuses the TMA descriptor of q, k,
/// v or dout (tma.cuh).
void masked_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* o, const float* lse,
                               const bf16* dout, const KvRange32* ranges, int64_t Nq, int64_t Nk, int H, int Hkv,
                               int D, float scale, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                               cudaStream_t stream, AttentionKernel kernel = AttentionKernel::kAuto);

}  // namespace dflash::cuda
