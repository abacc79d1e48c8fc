// The mixture-of-experts FFN on the GPU (Qwen3.5/3.6-MoE, Qwen3-Next; transformers
// models/qwen2_moe/modular_qwen2_moe.py: Qwen2MoeTopKRouter, Qwen2MoeSparseMoeBlock, MixtralExperts).
// Routing never leaves the GPU: the router's top-k, the per-expert counts and offsets, the
// permutation of token copies into expert order and the grouped GEMMs' tile table are all made on
// the device, so a forward has no host synchronisation. The CPU reference is moe_forward /
// moe_route in src/models/target.h.
#pragma once
#include <cstdint>

#include "gpu/runtime.h"
#include "ops/cuda/gemm.h"

namespace dflash::cuda {

/// Router on the GPU, as moe_route (src/models/target.h): logits [T, ld] fp32 (columns 0..E-1 are
/// the experts'; ld >= E), softmax in fp32, the k largest (lower index first on ties), weights
/// renormalized to sum 1 when norm_topk_prob. Writes ids [T, k] int32 and weights [T, k] fp32 and
/// adds each token's picks to counts [E] (zero it first). A token with a non-finite logit picks
/// experts 0..k-1 with NaN weights, so its output is NaN (found downstream, never an arbitrary
/// expert). Requires 1 <= k <= 32, k <= E <= 1024 (std::invalid_argument).
void moe_route(const float* logits, int64_t ld, int64_t T, int E, int k, bool norm_topk_prob, int32_t* ids,
               float* weights, int32_t* counts, cudaStream_t stream);

/// Rows per tile of grouped_gemm (an expert's rows are cut into tiles of this many).
constexpr int kGroupedGemmRows = 64;

/// From counts [E]: offsets [E + 1] (exclusive prefix sum: expert e owns permuted rows
/// offsets[e]..offsets[e+1]), tile_start [E + 1] (the same over ceil(counts / kGroupedGemmRows)),
/// then for every pick i = t * k + j: a slot row in its expert's range, rows [slot] = t (the source
/// token) and slot_of [i] = slot. Slots within an expert are in no fixed order; every slot is
/// computed on its own, so results do not depend on it. E <= 1024 (std::invalid_argument).
void moe_permute(const int32_t* ids, const int32_t* counts, int64_t T, int E, int k, int32_t* offsets,
                 int32_t* tile_start, int32_t* rows, int32_t* slot_of, cudaStream_t stream);

/// Grouped GEMM over experts (bf16 in, fp32 accumulation, fp32 out; mma.sync tensor cores):
///   C [r, :] = A [a_rows ? a_rows[r] : r, :] @ B[e]^T   for r in offsets[e]..offsets[e+1], every e,
/// A [*, K] bf16, B [E, N, K] bf16 (nn.Linear weights per expert), C [total_rows, N] fp32. The
/// expert of each tile comes from tile_start (device memory, moe_permute): no host synchronisation.
/// total_rows = offsets[E] (known on the host: T * k). Requires N and K multiples of 8, A and B
/// 16-byte aligned (as every device allocation is) and total_rows / kGroupedGemmRows + E < 65536
/// (std::invalid_argument).
void grouped_gemm(const bf16* A, const int32_t* a_rows, const bf16* B, const int32_t* offsets, const int32_t* tile_start,
                  int E, int64_t total_rows, int64_t N, int64_t K, float* C, cudaStream_t stream);

/// Shapes of one MoE FFN: T tokens of width D, E experts of which k per token, expert width Im,
/// shared expert width Is (0: none).
struct MoeShape {
  int64_t T = 0, D = 0;
  int E = 0, k = 0;
  int64_t Im = 0, Is = 0;
  bool norm_topk_prob = true;
};

/// Weights of one MoE FFN on the device (bf16, nn.Linear layout [out, in]).
struct MoeWeightsGpu {
  const bf16* router = nullptr;   // [E + (Is > 0), D]: the router's rows, then shared_expert_gate's row
  const bf16* gate_up = nullptr;  // [E, 2 * Im, D]: per expert gate_proj rows, then up_proj rows
  const bf16* down = nullptr;     // [E, D, Im]
  const bf16* shared_gate_up = nullptr;    // [2 * Is, D]: shared_expert's gate_proj rows, then up_proj rows
  const bf16* shared_down_proj = nullptr;  // [D, Is]
};

/// x [T, D] fp32 += MoE(h): h [T, D] bf16 (the post-attention RMSNorm's output). Router logits by
/// cuBLASLt (fp32 out), moe_route, moe_permute, grouped_gemm (gate_up, gathering h's rows), SwiGLU
/// to bf16, grouped_gemm (down), then per token the weighted sum of its k expert outputs (most likely
/// first) plus sigmoid(shared gate) * shared_expert(h). Temporaries come from the stream's pool.
/// Throws as the functions above, std::runtime_error on CUDA / cuBLASLt errors.
void moe_ffn_forward(GemmContext& gemm, const MoeShape& s, const MoeWeightsGpu& w, const bf16* h, float* x);

/// The most moe_ffn_forward holds in temporaries at once for shapes `s` (bytes): the routing, the
/// experts' outputs and the larger of the experts' gate | up products and the shared expert's.
int64_t moe_ffn_workspace_bytes(const MoeShape& s);

}  // namespace dflash::cuda
