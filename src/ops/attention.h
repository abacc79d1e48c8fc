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

/// Throws std::invalid_argument unless cu starts at 0, is non-decreasing and ends at T.
void check_cu_seqlens(const std::vector<int64_t>& cu, int64_t T, const char* what);

}  // namespace dflash::cpu
