// The DFlash drafter on the CPU: weights (published checkpoint layout), and the forward + hand-written
// backward of one training sequence (docs/dflash.md "Training"; conventions as
// scripts/dflash_reference.py, the PyTorch reference the golden tests/fixtures/drafter was made with).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/drafter_config.h"
#include "tensor/tensor.h"

namespace dflash {

/// One draft layer's weights (names as the checkpoint: layers.{i}.self_attn.q_proj.weight, ...).
template <typename T>
struct DrafterLayerWeights {
  BasicTensor<T> q_proj, k_proj, v_proj, o_proj;  // [H*hd, d], [Hkv*hd, d], [Hkv*hd, d], [d, H*hd]
  BasicTensor<T> q_norm, k_norm;                  // [hd]
  BasicTensor<T> input_layernorm, post_attention_layernorm;  // [d]
  BasicTensor<T> gate_proj, up_proj, down_proj;   // [I, d], [I, d], [d, I]
};

/// All drafter parameters. The same struct holds gradients (DrafterGrads).
template <typename T>
struct DrafterWeights {
  BasicTensor<T> fc;           // [d, K*d]
  BasicTensor<T> hidden_norm;  // [d]
  std::vector<DrafterLayerWeights<T>> layers;
  BasicTensor<T> norm;         // [d]
  // A DSpark drafter's heads (src/models/dspark.h; empty for DFlash), r = markov_rank:
  BasicTensor<T> markov_w1;     // [V, r] markov_head.markov_w1.weight (an embedding of the previous token)
  BasicTensor<T> markov_w2;     // [V, r] markov_head.markov_w2.weight (Linear r -> V)
  BasicTensor<T> confidence_w;  // [1, d + r] confidence_head.proj.weight
  BasicTensor<T> confidence_b;  // [1] confidence_head.proj.bias

  /// (checkpoint name, tensor) for every parameter, in a fixed order (layers first, then fc,
  /// hidden_norm, norm, then a DSpark drafter's heads).
  std::vector<std::pair<std::string, BasicTensor<T>*>> named();
  std::vector<std::pair<std::string, const BasicTensor<T>*>> named() const;
};
template <typename T>
using DrafterGrads = DrafterWeights<T>;

/// Checkpoint name -> expected shape, for `c`.
std::vector<std::pair<std::string, std::vector<int64_t>>> drafter_param_shapes(const DrafterConfig& c);

/// Zero tensors of the right shapes.
template <typename T>
DrafterWeights<T> drafter_zeros(const DrafterConfig& c);

/// Loads a DFlash checkpoint directory: config.json (drafter_config_from_json) + model.safetensors
/// or a sharded model.safetensors.index.json set (F32/BF16/F16/F64, converted through float32;
/// a leading "model." prefix is stripped, as the
/// reference loader does). Strict: a missing, unexpected or mis-shaped tensor throws
/// std::runtime_error naming the file and the tensor. Writes the config to *cfg if non-null.
template <typename T>
DrafterWeights<T> load_drafter_weights(const std::string& dir, DrafterConfig* cfg);

/// One training sequence. Anchors are the valid ones only (sorted, each in [0, S)); blocks
/// anchors.size() .. num_blocks-1 are padding blocks (all MASK tokens, positions 0..B-1, see
/// nothing, output of their attention 0, loss weight 0).
template <typename T>
struct DrafterSequence {
  const BasicTensor<T>* taps = nullptr;     // [S, K*d], concatenated target taps
  std::vector<int64_t> ids;                 // [S]
  std::vector<int64_t> loss_mask;           // [S] (0/1)
  std::vector<int64_t> anchors;             // sorted valid anchors
  int64_t num_blocks = 0;                   // >= anchors.size()
  const BasicTensor<T>* embed = nullptr;    // [V, d], frozen target embed_tokens
  const BasicTensor<T>* lm_head = nullptr;  // [V, d], frozen target lm_head (logits = h @ lm_head^T)
  /// DSpark only: [S, d], the target's final hidden states (after its final norm: hidden_states[L]),
  /// whose logits the drafter's distributions are matched to.
  const BasicTensor<T>* target_hidden = nullptr;
  /// DSpark only, tests: [num_blocks B] confidence targets held fixed (dspark_loss's fixed_targets).
  const std::vector<T>* confidence_targets = nullptr;
  double gamma = 7.0;                       // loss decay: w_k = exp(-(k-1)/gamma) (DSpark: exp(-k/gamma))
  bool dpace = false;                       // D-PACE weights (dpace_weights) instead of the gamma decay
};

/// How a block's slots weigh in the loss: DFlash's decay exp(-(k-1)/gamma), or D-PACE's.
struct LossWeighting {
  double gamma = 7.0;
  bool dpace = false;
};

/// D-PACE's slot weights (docs/dflash.md "Variants trained here"; arXiv 2605.18810), detached from the graph: per block
/// of B rows (row = b B + k), q_k = exp(-CE_k), q~_k = (q_k + 1) / 2, P_k = prod_{1 <= i <= k} q~_i and
/// w_k = sum_{m >= k} P_m; a row without a label (valid false: slot 0, padding, a prompt or
/// past-the-end label) weighs 0 and counts q~ = 1. ce, valid [N B]. Throws std::invalid_argument on sizes.
std::vector<double> dpace_weights(const std::vector<double>& ce, const std::vector<bool>& valid, int64_t B);

struct DrafterStepOptions {
  bool backward = true;       // compute the gradients
  bool keep_logits = false;   // fill DrafterStepResult::logits [num_blocks * B, V]
  int64_t ce_row_chunk = 64, ce_vocab_chunk = 4096;
};

template <typename T>
struct DrafterStepResult {
  T loss = 0;                        // sum(w * CE) / sum(w) (0 when sum(w) == 0)
  T weight_sum = 0;                  // sum(w)
  std::vector<int64_t> slot_correct; // [B] top-1 hits over positions with w > 0 (slot 0: 0)
  std::vector<int64_t> slot_count;   // [B] positions with w > 0
  DrafterGrads<T> grads;             // d loss / d parameter (if options.backward)
  BasicTensor<T> logits;             // [num_blocks * B, V] (if options.keep_logits)
  std::vector<T> confidence_targets; // DSpark: [num_blocks * B] the detached targets it used
};

/// The host-side layout of one sequence's blocks (shared by the CPU and GPU steps), rows r = b * B + k:
/// block b = [ids[a_b], MASK x (B-1)] for valid blocks, all MASK at positions 0..B-1 for padding
/// blocks; label of slot k >= 1 = ids[a + k] with weight exp(-(k-1)/gamma) * loss_mask[a + k] when
/// a + k < S (else 0, as slot 0 and padding).
struct BlockLayout {
  std::vector<int32_t> block_ids;  // [Q] input token of each row
  std::vector<int64_t> pos_q;      // [Q] RoPE position of each row (a + k)
  std::vector<int64_t> pos_kv;     // [S + Q] context positions 0..S-1, then pos_q
  std::vector<int32_t> labels;     // [Q] (0 where the weight is 0)
  std::vector<double> weights;     // [Q]
  double weight_sum = 0;
};
BlockLayout block_layout(const std::vector<int64_t>& ids, const std::vector<int64_t>& loss_mask,
                         const std::vector<int64_t>& anchors, int64_t num_blocks, int64_t block_size,
                         int64_t mask_token_id, double gamma);

/// Forward (and backward) of the drafter over one sequence, exactly as scripts/dflash_reference.py:
/// ctx = hidden_norm(fc(taps)); block b = [ids[a_b], MASK x (B-1)] embedded; per layer
/// h = input_layernorm(x) (block tokens only), Q from h, K/V from [ctx ; h] (k_norm on all keys),
/// RoPE (context j -> j, slot k -> a + k), dflash_kv_ranges mask (sliding_window for sliding layers),
/// o_proj + residual, post_attention_layernorm, SwiGLU MLP + residual; final norm; weighted CE
/// against lm_head with w = exp(-(k-1)/gamma) * loss_mask[a+k] * (a+k < S) for k >= 1, or with
/// seq.dpace the D-PACE weights of the same rows from their CE (a first, forward-only cross entropy).
/// RoPE angles and cos/sin are computed in double (as the reference) and rounded to T.
/// A DSpark drafter (cfg.is_dspark()) takes dspark_loss (src/models/dspark.h) over the same final hidden
/// states instead of the cross entropy; its logits (keep_logits) are the Markov-corrected ones.
/// Throws std::invalid_argument on inconsistent shapes or inputs.
template <typename T>
DrafterStepResult<T> drafter_step(const DrafterConfig& cfg, const DrafterWeights<T>& w, const DrafterSequence<T>& seq,
                                  const DrafterStepOptions& opt = {});

/// Drafting with a cache of context features (docs/dflash.md "Serving loop"): for each draft
/// layer the keys (k_proj, k_norm, RoPE at their positions) and values of the context rows, grown as
/// tokens are committed, so a draft projects only its own block.
struct DrafterContextCache {
  int64_t length = 0;        // context rows (positions 0 .. length - 1)
  std::vector<Tensor> k, v;  // per layer [length, Hkv, hd]
};

/// Appends the context rows of positions c.length .. c.length + m - 1 from their target taps [m, K*d]:
/// ctx = hidden_norm(fc(taps)), then each layer's keys and values of ctx. Throws std::invalid_argument
/// on shapes.
void drafter_extend_context(const DrafterConfig& cfg, const DrafterWeights<float>& w, DrafterContextCache& c,
                            const Tensor& taps);

/// Logits [B, V] of the block [last_token, MASK x (B-1)] at positions c.length .. c.length + B - 1 (its
/// anchor is the last committed token, whose own features the mask hides): the same computation as
/// drafter_step's logits for one block anchored at c.length, with the context from the cache.
/// embed / lm_head [V, d]. Throws std::invalid_argument for a token outside the vocabulary.
Tensor drafter_draft_logits(const DrafterConfig& cfg, const DrafterWeights<float>& w, const DrafterContextCache& c,
                            int32_t last_token, const Tensor& embed, const Tensor& lm_head);
/// The final hidden states [B, d] (after the final norm) of that block, whose lm_head product is
/// drafter_draft_logits.
Tensor drafter_draft_hidden(const DrafterConfig& cfg, const DrafterWeights<float>& w, const DrafterContextCache& c,
                            int32_t last_token, const Tensor& embed);

}  // namespace dflash
