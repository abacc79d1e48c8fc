// What a target model is: architecture, shapes and layer plan, independent of the file format.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ops/rope_spec.h"

namespace dflash {

/// Target architectures the engine runs. One file per architecture lives in src/models/.
enum class Arch { Llama, Qwen3, Qwen3_5 };

/// Token mixer of a decoder layer.
enum class LayerKind {
  Attention,      // causal softmax attention (Llama / Qwen3 / Qwen3.5 gated full attention)
  GatedDeltaNet,  // Qwen3.5 linear_attention layer
};

/// A target model's configuration, normalized from config.json (HF) or GGUF metadata.
/// All sizes are element counts. Weight names follow Hugging Face with `weight_prefix`
/// ("model." or "model.language_model.") in front of "embed_tokens", "layers.{i}", "norm".
struct ModelSpec {
  Arch arch = Arch::Llama;
  std::string architecture;  // as in config.json "architectures"[0], e.g. "Qwen3ForCausalLM"
  std::string model_type;    // config.json "model_type" (outer one for wrappers)
  std::string weight_prefix = "model.";

  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  RopeSpec rope;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  std::string hidden_act = "silu";

  // Qwen3.5 GatedDeltaNet shapes (zero for other architectures).
  int64_t linear_num_key_heads = 0, linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0, linear_value_head_dim = 0, linear_conv_kernel_dim = 0;

  std::vector<LayerKind> layer_types;  // size num_hidden_layers

  // Mixture-of-experts FFN (Qwen3.5/3.6-MoE, Qwen3-Next; transformers Qwen2MoeSparseMoeBlock): a
  // softmax router picks num_experts_per_tok of num_experts SwiGLU experts (moe_intermediate_size),
  // plus a shared expert (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate).
  // num_experts == 0: every layer has the dense MLP (intermediate_size).
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0, shared_expert_intermediate_size = 0;
  bool norm_topk_prob = true;             // renormalize the top-k probabilities to sum 1
  int64_t decoder_sparse_step = 1;        // layer i is sparse iff (i + 1) % step == 0 and i not in mlp_only_layers
  std::vector<int64_t> mlp_only_layers;
  /// Qwen3-Next stores the GatedDeltaNet projections fused and grouped per key head (in_proj_qkvz,
  /// in_proj_ba); the loader permutes them into in_proj_qkv / z / b / a.
  bool gdn_fused_projections = false;

  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;

  /// Qwen3.5 uses zero-centered RMSNorm (y = x_hat * (1 + w)) for layer, final and q/k norms.
  bool zero_centered_norm() const { return arch == Arch::Qwen3_5; }
  /// Qwen3 and Qwen3.5 attention carry per-head q_norm / k_norm.
  bool has_qk_norm() const { return arch != Arch::Llama; }
  /// Qwen3.5 full attention has a sigmoid output gate packed into q_proj.
  bool attn_output_gate() const { return arch == Arch::Qwen3_5; }
  /// Layer i's FFN is the mixture of experts (else the dense MLP).
  bool is_moe_layer(int64_t i) const;
  /// Number of dims of each head that RoPE rotates.
  int64_t rotary_dim() const { return int64_t(double(head_dim) * rope.partial_rotary_factor); }
  /// Throws std::runtime_error (prefixed by `where`) when shapes are inconsistent.
  void validate(const std::string& where) const;
};

std::string layer_kind_name(LayerKind k);

}  // namespace dflash
