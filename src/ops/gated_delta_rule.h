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

}  // namespace dflash::cpu
