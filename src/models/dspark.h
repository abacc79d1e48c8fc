// DSpark (docs/dflash.md "Variants trained here"; arXiv 2607.05147; DeepSpec deepspec/modeling/dspark): a DFlash
// backbone whose every block slot predicts (slot k -> token anchor + k + 1), with a low-rank Markov head
// on the previous token and a confidence head. The CPU reference of its loss (forward and hand-written
// backward) and of its greedy drafting; the backbone is drafter.cpp's.
//
//   e_k      = W1[prev_k]                               (r)   prev_0 = anchor token, prev_k = token a + k
//   z_k      = lm_head h_k + W2 e_k                     (V)   h_k: the backbone's final hidden state
//   c_k      = w_c . [h_k ; e_k] + b_c                        confidence logit
//   t_k      = lm_head g_{a+k}                          (V)   g: the target's own final hidden states
//   L1_k     = || softmax(z_k) - softmax(t_k) ||_1,  y_k = clamp(1 - L1_k / 2, 0, 1) (detached)
//   loss     = sum_k w_k (0.1 CE(z_k, ids[a+k+1]) + 0.9 L1_k + BCE(c_k, y_k)) / sum_k w_k
//   w_k      = exp(-k / gamma) * prod_{i <= k} [a + i + 1 < S and loss_mask[a + i + 1]]
// (DeepSpec deepspec/modeling/dspark/loss.py: one weight mask and one denominator for the three terms.)
#pragma once
#include <cstdint>
#include <vector>

#include "models/drafter.h"

namespace dflash {

/// The loss's per-row inputs over N blocks of B (row r = b B + k); padding blocks (b >= anchors) weigh 0.
struct DSparkRows {
  std::vector<int32_t> labels;      // [Q] ids[a + k + 1] (0 where the weight is 0)
  std::vector<int32_t> prev;        // [Q] the Markov head's previous token: ids[a + k] (teacher forcing)
  std::vector<int64_t> target_row;  // [Q] the context row whose target logits slot k matches: a + k
  std::vector<double> weights;      // [Q] w_k above
  double weight_sum = 0;
};
/// Throws std::invalid_argument for gamma <= 0, an anchor outside [0, S) or sizes that disagree.
DSparkRows dspark_rows(const std::vector<int64_t>& ids, const std::vector<int64_t>& loss_mask,
                       const std::vector<int64_t>& anchors, int64_t num_blocks, int64_t block_size, double gamma);

/// The loss terms' weighted means and the top-1 hits of the corrected logits z (rows with w > 0).
template <typename T>
struct DSparkLossResult {
  T loss = 0, ce = 0, l1 = 0, bce = 0;  // loss = 0.1 ce + 0.9 l1 + bce (0 when no row weighs)
  T weight_sum = 0;
  std::vector<int64_t> slot_correct, slot_count;  // [B]
  BasicTensor<T> dh;                              // [Q, d] d loss / d h (with a backward)
  std::vector<T> confidence_targets;              // [Q] y_k (0 where the weight is 0)
};

/// The loss above over h [Q, d] (the backbone's final hidden states, after its norm), the target's final
/// hidden states g [S, d] and lm_head [V, d], with w's Markov and confidence heads. With `grads`, adds the
/// heads' gradients to grads->markov_w1 / markov_w2 / confidence_w / confidence_b and fills dh. Throws
/// std::invalid_argument on shapes, or for a token outside the vocabulary. `fixed_targets` [Q], when
/// given, replaces the detached y (finite-difference tests hold it fixed, as autograd does).
template <typename T>
DSparkLossResult<T> dspark_loss(const DrafterWeights<T>& w, const BasicTensor<T>& h, const BasicTensor<T>& g,
                                const BasicTensor<T>& lm_head, const DSparkRows& rows, int64_t B, DrafterGrads<T>* grads,
                                const std::vector<T>* fixed_targets = nullptr);

/// The corrected logits [Q, V]: lm_head h_r + W2 W1[prev_r].
template <typename T>
BasicTensor<T> dspark_logits(const DrafterWeights<T>& w, const BasicTensor<T>& h, const BasicTensor<T>& lm_head,
                             const std::vector<int32_t>& prev);

/// Greedy drafting (DeepSpec eval/dspark draft_ops, SGLang run_markov_block): the Markov walk over one
/// block's final hidden states h [B, d]: prev = last (the anchor), token_k = argmax(lm_head h_k +
/// W2 W1[prev]), prev = token_k. Returns the B tokens. Throws std::invalid_argument for `last` outside
/// the vocabulary.
std::vector<int32_t> dspark_greedy_drafts(const DrafterWeights<float>& w, const Tensor& h, int32_t last,
                                          const Tensor& lm_head);

}  // namespace dflash
