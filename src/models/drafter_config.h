// The DFlash drafter's configuration: derived from a target (docs/dflash.md, "Drafter
// architecture"), overridable, and written / read as the DFlash checkpoint's config.json.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "models/model_spec.h"
#include "text/chat_template.h"

namespace dflash {

class Tokenizer;

/// Shapes and DFlash fields of a drafter. Field names follow the checkpoint's config.json.
struct DrafterConfig {
  int64_t hidden_size = 0, intermediate_size = 0, num_hidden_layers = 5;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  /// RoPE over the whole head_dim: rope_theta, and rope_scaling (llama3, yarn) as transformers reads it.
  RopeSpec rope = default_rope();
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 32768;    // transformers' Qwen3Config default; servers size RoPE by it
  int64_t block_size = 16;
  int64_t num_target_layers = 0;              // layers of the target
  std::vector<int64_t> target_layer_ids;      // taps: output of target layer i = hidden_states[i + 1]
  int64_t mask_token_id = -1;                 // -1: not given (older configs); resolve_mask_token_id
  std::vector<std::string> layer_types;       // "full_attention" | "sliding_attention", one per layer
  int64_t sliding_window = 0;                 // used by sliding_attention layers
  /// Causal attention inside the block for every layer (config.json `is_causal`, else
  /// `dflash_config.causal`, as vLLM reads them); unset: full layers see their whole block (dflash.md).
  std::optional<bool> causal;
  /// DSpark (docs/dflash.md "Variants trained here"; src/models/dspark.h): the rank r of its low-rank Markov head
  /// (vanilla: logits += W2 W1[previous token]) beside a confidence head; 0 for a DFlash drafter.
  int64_t markov_rank = 0;

  bool is_dspark() const { return markov_rank > 0; }
  /// Tokens one draft proposes: B - 1 for DFlash (slot 0 is the anchor), B for DSpark (slot k
  /// predicts anchor + k + 1). The target verifies these plus the anchor.
  int64_t drafts_per_block() const { return is_dspark() ? block_size : block_size - 1; }
  bool is_sliding(int64_t layer) const;
  /// The layer's sliding window (0 for a full layer): it sees context [a + k - (window - 1), a).
  int64_t layer_window(int64_t layer) const { return is_sliding(layer) ? sliding_window : 0; }
  /// Whether slot k of a block sees only slots 0..k: `causal` for every layer, and always for a
  /// sliding layer (both servers run its window as FlashAttention's (window - 1, 0), which looks back only).
  bool layer_causal(int64_t layer) const { return is_sliding(layer) || causal.value_or(false); }

  /// Throws std::runtime_error prefixed by `where` when fields disagree or no server would serve the
  /// drafter: head shapes, taps not strictly increasing, outside the target or on its last layer
  /// (servers capture layer inputs: there is none after it), mask id outside the vocabulary,
  /// max_position_embeddings <= 0, layer_types size, sliding window, RoPE.
  void validate(const std::string& where) const;
  static RopeSpec default_rope() {
    RopeSpec r;
    r.theta = 1e6;
    return r;
  }
};

/// The target layers a training run captures for drafter `c`: target_layer_ids, then for DSpark the
/// target's last layer (num_target_layers - 1: its final hidden states after the final norm,
/// hidden_states[L]), whose d columns follow the taps in every captured row: [taps (K d) | final (d)].
std::vector<int64_t> captured_layer_ids(const DrafterConfig& c);

/// What a user may override (unset = the default the doc gives).
struct DrafterOverrides {
  std::optional<int64_t> num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim;
  std::optional<int64_t> intermediate_size, block_size, mask_token_id, num_taps, sliding_window;
  std::optional<double> rope_theta;
  std::optional<int64_t> markov_rank;  // > 0: a DSpark drafter with a Markov head of this rank
  std::optional<std::vector<int64_t>> target_layer_ids;
  /// Indices of drafter layers that use sliding-window attention (needs sliding_window).
  std::vector<int64_t> sliding_layers;
  /// Every layer's type ("full_attention" / "sliding_attention"); sets the layer count (a
  /// num_hidden_layers that disagrees throws).
  std::vector<std::string> layer_types;
  /// rope_scaling as transformers reads it (null: none), over the rope theta.
  nlohmann::json rope_scaling;
};

/// Checks that a drafter fits a target before any work: hidden size, vocabulary (mask_token_id inside
/// it), target_layer_ids within the target's layers. Throws std::invalid_argument naming both.
void check_drafter_fits(const DrafterConfig& d, const ModelSpec& target, const std::string& drafter_path);

/// dflash.md's default taps for a target of `num_target_layers` layers and `n` taps:
/// n == 1 -> [L / 2] (for L = 2: [0], never the last layer); else round(1 + i * (L - 4) / (n - 1)), i = 0..n-1 (Python's round: half to even).
/// Examples: (36, 5) -> [1, 9, 17, 25, 33]; (64, 5) -> [1, 16, 31, 46, 61].
std::vector<int64_t> default_target_layer_ids(int64_t num_target_layers, int64_t n);

/// The mask token: `<|MASK|>` when the tokenizer has it; for a Qwen3.5 / 3.6 target with the Qwen3.5
/// tokenizer 248070 (`<|audio_start|>`, the published drafters' id); else the first embedding row
/// past the tokenizer's ids when the target has spare rows (Qwen3: 151669); else the highest-id special
/// token that is neither BOS/EOS nor written by the chat template. Never a stop token (check_mask_token).
/// Throws std::runtime_error when none exists.
int64_t default_mask_token_id(const ModelSpec& target, const Tokenizer& tok);
/// Stop tokens for chat generation: the target's eos_token_id(s), the tokenizer's EOS and the chat
/// family's end-of-turn token, sorted, each once.
std::vector<int64_t> chat_stop_tokens(const ModelSpec& target, const Tokenizer& tok, ChatFamily family);

/// Throws std::invalid_argument naming `where` when `id` ends a turn or a sequence for this target
/// and tokenizer (its EOS ids, the tokenizer's EOS, the chat template's end-of-turn token): a drafter
/// fills its block with the mask, and a server that checks drafted tokens for a stop would stop there.
void check_mask_token(int64_t id, const ModelSpec& target, const Tokenizer& tok, const std::string& where);

/// The drafter for `target` (hidden size, intermediate size (3 x hidden for a target with only
/// mixture-of-experts layers) and rope theta of the target; attention
/// shape of the target for Llama / Qwen3, 32 / 8 / 128 for Qwen3.5 hybrids), with overrides applied.
/// `tok` supplies the default mask token (required unless overrides.mask_token_id is set).
DrafterConfig derive_drafter_config(const ModelSpec& target, const Tokenizer* tok, const DrafterOverrides& o);

/// config.json of a DFlash checkpoint (architectures DFlashDraftModel, model_type qwen3,
/// dflash_config {mask_token_id, target_layer_ids[, causal]}, standard Qwen3 fields,
/// rope_scaling when the RoPE is scaled). A DSpark drafter: architectures Qwen3DSparkModel and, at the
/// top level where SGLang and vLLM read them, markov_rank, markov_head_type "vanilla",
/// enable_confidence_head and confidence_head_with_markov true. Loads with z-lab's `DFlashDraftModel.from_pretrained`, SGLang and vLLM; not
/// with `AutoModel.from_pretrained(..., trust_remote_code=True)`: no modeling file is shipped.
nlohmann::json drafter_config_to_json(const DrafterConfig& c);
/// Reads a DFlash config.json (ours, z-lab's or SpecForge's) as SGLang / vLLM read it: block_size in
/// dflash_config or at the top level; rope_scaling / rope_parameters; sliding_window only with
/// use_sliding_window (else none, as transformers); layer_types, or derived from max_window_layers
/// (transformers' Qwen3Config); dflash_config.use_swa (every layer sliding when layer_types has none)
/// with swa_window_size before sliding_window; is_causal / dflash_config.causal; DSpark's markov_rank
/// (top level, dspark_config or dspark_markov_rank, as SGLang's parse_dspark_draft_config; only the
/// vanilla head with a confidence head on it, and DeepSpec's slot convention: a speculators config is
/// refused, as SGLang refuses it). Throws naming `where`
/// and the field, and for what no server would serve (DrafterConfig::validate).
/// Older z-lab configs without dflash_config.target_layer_ids get
/// default_target_layer_ids(num_target_layers, num_hidden_layers) (one tap per draft layer, as the
/// z-lab / SGLang loaders); without dflash_config.mask_token_id, mask_token_id is -1 (see
/// resolve_mask_token_id).
DrafterConfig drafter_config_from_json(const nlohmann::json& j, const std::string& where);

/// Sets c.mask_token_id from the tokenizer's `<|MASK|>` when the config did not give one (-1), as
/// the z-lab / SGLang loaders do. Throws std::runtime_error naming `where` when there is none.
void resolve_mask_token_id(DrafterConfig& c, const Tokenizer& tok, const std::string& where);

}  // namespace dflash
