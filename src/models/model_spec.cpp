#include "models/model_spec.h"

#include <algorithm>

#include <stdexcept>

namespace dflash {

std::string layer_kind_name(LayerKind k) {
  return k == LayerKind::Attention ? "full_attention" : "linear_attention (GatedDeltaNet)";
}

void ModelSpec::validate(const std::string& where) const {
  auto fail = [&](const std::string& m) { throw std::runtime_error(where + ": " + m); };
  // Upper bounds far above any real model keep a hostile config from asking for absurd memory.
  auto pos = [&](int64_t v, const char* name, int64_t max = int64_t(1) << 24) {
    if (v <= 0 || v > max)
      fail(std::string(name) + " must be in [1, " + std::to_string(max) + "] (got " + std::to_string(v) + ")");
  };
  pos(vocab_size, "vocab_size");
  pos(hidden_size, "hidden_size");
  pos(num_hidden_layers, "num_hidden_layers", 4096);
  if (num_experts < 0) fail("num_experts must not be negative (got " + std::to_string(num_experts) + ")");
  bool any_dense = false;
  for (int64_t i = 0; i < num_hidden_layers && !any_dense; ++i) any_dense = !is_moe_layer(i);
  if (any_dense) pos(intermediate_size, "intermediate_size");
  if (num_experts > 0) {
    if (arch != Arch::Qwen3_5) fail("mixture-of-experts layers exist only in Qwen3.5/3.6-MoE and Qwen3-Next models");
    pos(num_experts, "num_experts", 4096);
    pos(num_experts_per_tok, "num_experts_per_tok", num_experts);
    pos(moe_intermediate_size, "moe_intermediate_size");
    pos(decoder_sparse_step, "decoder_sparse_step", 4096);
    if (shared_expert_intermediate_size < 0 || shared_expert_intermediate_size > (int64_t(1) << 24))
      fail("shared_expert_intermediate_size must be in [0, 16777216] (got " +
           std::to_string(shared_expert_intermediate_size) + ")");
    for (int64_t i : mlp_only_layers)
      if (i < 0 || i >= num_hidden_layers)
        fail("mlp_only_layers holds layer " + std::to_string(i) + ", outside the " + std::to_string(num_hidden_layers) +
             " layers");
  }
  pos(num_attention_heads, "num_attention_heads", 4096);
  pos(num_key_value_heads, "num_key_value_heads", 4096);
  pos(head_dim, "head_dim", 4096);
  if (num_attention_heads % num_key_value_heads != 0)
    fail("num_attention_heads (" + std::to_string(num_attention_heads) + ") is not a multiple of num_key_value_heads (" +
         std::to_string(num_key_value_heads) + ")");
  if (int64_t(layer_types.size()) != num_hidden_layers)
    fail("layer_types has " + std::to_string(layer_types.size()) + " entries for " + std::to_string(num_hidden_layers) +
         " layers");
  if (rotary_dim() <= 0 || rotary_dim() % 2 != 0 || rotary_dim() > head_dim)
    fail("rotary dim " + std::to_string(rotary_dim()) + " (head_dim x partial_rotary_factor) must be even, in (0, head_dim]");
  if (!(rms_norm_eps > 0)) fail("rms_norm_eps must be positive");
  if (hidden_act != "silu") fail("hidden_act '" + hidden_act + "' is not supported (only silu)");
  for (LayerKind k : layer_types) {
    if (k != LayerKind::GatedDeltaNet) continue;
    if (arch != Arch::Qwen3_5) fail("linear_attention layers exist only in Qwen3.5/3.6 models");
    pos(linear_num_key_heads, "linear_num_key_heads");
    pos(linear_num_value_heads, "linear_num_value_heads");
    pos(linear_key_head_dim, "linear_key_head_dim");
    pos(linear_value_head_dim, "linear_value_head_dim");
    pos(linear_conv_kernel_dim, "linear_conv_kernel_dim", 64);
    if (linear_num_value_heads % linear_num_key_heads != 0)
      fail("linear_num_value_heads is not a multiple of linear_num_key_heads");
    break;
  }
}

bool ModelSpec::is_moe_layer(int64_t i) const {
  return num_experts > 0 && decoder_sparse_step > 0 && (i + 1) % decoder_sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) == mlp_only_layers.end();
}

}  // namespace dflash
