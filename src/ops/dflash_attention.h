// Masked (block-sparse) softmax attention of the DFlash drafter, forward and backward (reference).
// Math: o = softmax(q k^T * scale + mask) v per query head, GQA; the backward is the flash-attention
// recompute (Dao et al., FlashAttention-2 Alg. 2): P = exp(S - lse), dV = P^T dO, dP = dO V^T,
// dS = P * (dP - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q.
#pragma once
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace dflash::cpu {

/// The keys one query row may see: kv indices in [ctx_begin, ctx_end) U [blk_begin, blk_end)
/// (half-open; empty when end <= begin). For DFlash: a context prefix / window and a range of the
/// row's own block. The two ranges must not overlap (checked). A row whose ranges are both empty
/// sees nothing: output 0, zero gradient.
struct KvRanges {
  int64_t ctx_begin = 0, ctx_end = 0;
  int64_t blk_begin = 0, blk_end = 0;
};

/// DFlash mask as ranges, one per query row (num_blocks * block_size rows, row = b * B + k).
/// KV layout: [S context tokens ; num_blocks * B block tokens]; block b occupies kv S + b*B + [0, B).
/// Valid block b (b < anchors.size(), anchor a = anchors[b], 0 <= a <= S), slot k sees
///   context [0, a), or with a sliding window W > 0 [max(0, a + k - (W - 1)), a);
///   in its own block all B slots, or with `causal` (always with a window) slots 0..k.
/// Blocks b >= anchors.size() are padding and see nothing. Throws std::invalid_argument for a bad
/// anchor, block_size <= 0 or num_blocks < anchors.size().
std::vector<KvRanges> dflash_kv_ranges(const std::vector<int64_t>& anchors, int64_t num_blocks,
                                       int64_t block_size, int64_t context_len, int64_t window, bool causal);

/// Forward. q [Nq, H, D], k and v [Nk, Hkv, D], H % Hkv == 0 (query head h uses kv head h / (H / Hkv)),
/// ranges [Nq] (each inside [0, Nk]). Returns o [Nq, H, D]. Saves for the backward (if lse):
/// lse [Nq, H] = logsumexp over the allowed keys of q.k * scale (-inf for a row that sees nothing).
/// T = float or double; accumulation in T.
template <typename T>
BasicTensor<T> masked_attention_forward(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                                        const std::vector<KvRanges>& ranges, double scale, OutTensor<T>* lse);

/// Backward: given the forward's inputs, its output o, the saved lse and dout [Nq, H, D], writes
/// dq [Nq, H, D], dk and dv [Nk, Hkv, D] (each overwritten if non-null). Probabilities are recomputed
/// from lse, never stored.
template <typename T>
void masked_attention_backward(const BasicTensor<T>& q, const BasicTensor<T>& k, const BasicTensor<T>& v,
                               const BasicTensor<T>& o, const BasicTensor<T>& lse, const BasicTensor<T>& dout,
                               const std::vector<KvRanges>& ranges, double scale, OutTensor<T>* dq,
                               OutTensor<T>* dk, OutTensor<T>* dv);

}  // namespace dflash::cpu
