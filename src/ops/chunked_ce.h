// Weighted cross entropy against a frozen LM head, chunked over rows and vocabulary (reference).
// Math: z = h W^T, CE_m = logsumexp(z_m) - z_m[target_m], loss = sum_m w_m CE_m / sum_m w_m;
// d loss / d h_m = (w_m / sum w) (softmax(z_m) - onehot(target_m)) W. The logsumexp is built online
// over vocabulary chunks (running max and rescaled sum), so at most a [row_chunk, vocab_chunk] block
// of logits exists at once; the backward recomputes each logits block from the saved lse.
#pragma once
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace dflash::cpu {

template <typename T>
struct ChunkedCeResult {
  T loss = 0;                   ///< sum_m w_m CE_m / sum_m w_m (0 when sum w == 0)
  T weight_sum = 0;             ///< sum_m w_m
  std::vector<int32_t> argmax;  ///< [M] first index of the largest logit, every row (for top-1 accuracy)
  std::vector<T> ce;            ///< [M] unweighted CE_m; 0 for rows with w_m == 0 (their target is ignored)
  std::vector<T> lse;           ///< [M] logsumexp of the logits (saved for the backward)
};

/// Forward and (if dh) backward in one call. h [M, D], lm_head W [V, D] (V, D > 0; frozen: no dW), targets [M]
/// (in [0, V) where weights[m] != 0; ignored where weights[m] == 0), weights [M] (>= 0; the caller's
/// DFlash weights exp(-(k-1)/gamma) * loss_mask). dh [M, D] is overwritten with d loss / d h (rows with
/// w_m == 0 get 0). row_chunk, vocab_chunk > 0 bound the logits block; results do not depend on them
/// beyond rounding. Products via OpenBLAS gemm in T (float or double). Throws std::invalid_argument.
template <typename T>
ChunkedCeResult<T> chunked_cross_entropy(const BasicTensor<T>& h, const BasicTensor<T>& W,
                                         const std::vector<int32_t>& targets, const std::vector<T>& weights,
                                         int64_t row_chunk, int64_t vocab_chunk, OutTensor<T>* dh);

}  // namespace dflash::cpu
