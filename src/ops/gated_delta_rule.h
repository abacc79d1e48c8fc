// GatedDeltaNet pieces (Qwen3.5; transformers models/qwen3_5/modeling_qwen3_5.py,
// flash-linear-attention fla/ops/gated_delta_rule): causal depthwise conv1d and the recurrence.
#pragma once
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace dflash::cpu {

/// Causal depthwise conv1d + SiLU over packed sequences, zero left padding per sequence:
/// y[t, c] = silu(sum_{j<K} w[c, j] * x[t - K + 1 + j, c]) where rows before the start of t's
/// sequence count as zero, or, given `window` [n_seq, K-1, C] (decoding: the K-1 inputs before each
/// sequence's first row, oldest first), as those rows. x [T, C], w [C, K] -> y [T, C].
Tensor causal_conv1d_silu(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu_seqlens,
                          const Tensor* window = nullptr);

/// Gated delta rule, token by token (the reference every chunked kernel is tested against).
/// q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv] (g = log decay <= 0); Hv % Hk == 0 and value
/// head j reads key head j / (Hv / Hk). If use_qk_l2norm, q and k are l2-normalized (eps 1e-6)
/// first; q is then scaled by `scale`. Per sequence and value head, with state S [dk, dv] (fp32;
/// the dot products S^T k and S^T q summed in double):
///   S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t.
/// initial_state (optional) and final_state (optional out) are [n_seq, Hv, dk, dv]; a null
/// initial state means zeros. token_states (optional out, decoding rollback) [T, Hv, dk, dv] gets
/// the state after each token. Returns o [T, Hv, dv].
Tensor gated_delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                  const Tensor& beta, float scale, bool use_qk_l2norm,
                                  const std::vector<int64_t>& cu_seqlens,
                                  const Tensor* initial_state, Tensor* final_state,
                                  Tensor* token_states = nullptr);

/// The chunked gated delta rule with every intermediate, stage by stage as the GPU's kernels compute
/// them (src/ops/cuda/gdn_*.cu; the Gated DeltaNet paper's chunkwise form, Yang, Kautz and
/// Hatamizadeh 2024, in the WY / UT representation of flash-linear-attention's chunk_gated_delta_rule).
/// Chunks: each sequence of cu_seqlens cut every `chunk` tokens from its first row (the last one
/// may be shorter), in sequence order (cuda::GdnChunkPlan's order); n_chunks of them. Per chunk of
/// L tokens and value head h (key head h / (Hv / Hk)), with S0 the state before the chunk:
///   G_i = sum_{j <= i} g_j                                  (in the chunk)
///   A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i),  T = (I + A)^-1
///   w = T diag(beta exp(G)) K,  u = T diag(beta) V          (chunk_prepare)
///   P_ij = exp(G_i - G_j) q_i.k_j (j <= i, else 0)
///   U = u - w S0;  S = exp(G_L) S0 + (diag(exp(G_L - G)) K)^T U   (chunk_state)
///   O = diag(exp(G)) Q S0 + P U                             (chunk_out)
/// All fp32 tensors, computed in double and rounded once.
struct GdnChunkedTrace {
  Tensor G;            // [T, Hv] in-chunk cumulative log decays
  Tensor w;            // [T, Hv, dk]
  Tensor u;            // [T, Hv, dv]
  Tensor P;            // [n_chunks, Hv, chunk, chunk]: rows / columns past the chunk's L zero
  Tensor h;            // [n_chunks, Hv, dk, dv]: the state before each chunk
  Tensor v_new;        // [T, Hv, dv]: U, per token beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
  Tensor o;            // [T, Hv, dv]: the output, as gated_delta_rule_recurrent's
  Tensor final_state;  // [n_seq, Hv, dk, dv]
};

/// gated_delta_rule_recurrent (use_qk_l2norm false, scale 1: q and k as given, e.g. normalized and
/// scaled as cuda::gdn_prepare makes them) in chunks of `chunk` tokens (>= 1; the GPU's are 64),
/// returning its stages' intermediates (GdnChunkedTrace). q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta
/// [T, Hv]; initial_state (null: zeros) [n_seq, Hv, dk, dv]. Throws std::invalid_argument for bad
/// shapes, cu_seqlens or chunk.
GdnChunkedTrace gated_delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                         const Tensor& beta, const std::vector<int64_t>& cu_seqlens,
                                         const Tensor* initial_state, int64_t chunk = 64);

}  // namespace dflash::cpu
