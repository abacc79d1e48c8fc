// Causal softmax attention over packed variable-length sequences (reference).
#pragma once
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace dflash::cpu {

/// o [T, H, D] = softmax(q k^T * scale + causal mask) v, per sequence of the packed batch.
/// q [T, H, D], k and v [T, Hkv, D], H % Hkv == 0 (GQA: query head h uses kv head h / (H / Hkv)).
/// cu_seqlens [n + 1]: sequence s owns rows [cu[s], cu[s+1]); a token never sees another sequence.
/// Softmax in fp32 with max subtraction; dot products accumulated in float.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& cu_seqlens, float scale);

/// The same with a cached key prefix per sequence (decoding; flash-attn's varlen causal with
/// cu_seqlens_q != cu_seqlens_k, aligned bottom-right): q [Tq, H, D], k and v [Tk, Hkv, D];
/// sequence s owns query rows [cu_q[s], cu_q[s+1]) and key rows [cu_k[s], cu_k[s+1]), its queries
/// being its LAST keys' positions: query i of s sees keys cu_k[s] .. cu_k[s+1] - nq_s + i.
/// Throws std::invalid_argument when a sequence has more queries than keys.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& cu_q,
                        const std::vector<int64_t>& cu_k, float scale);

/// Throws std::invalid_argument unless cu starts at 0, is non-decreasing and ends at T.
void check_cu_seqlens(const std::vector<int64_t>& cu, int64_t T, const char* what);

}  // namespace dflash::cpu
