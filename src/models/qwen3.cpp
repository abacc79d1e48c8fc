// Qwen3 (transformers models/qwen3): Llama layout plus per-head q_norm / k_norm (plain RMSNorm over
// head_dim) before RoPE; head_dim may differ from hidden_size / num_attention_heads.
#include "models/hf_config.h"
#include "models/architectures.h"

namespace dflash {

ModelSpec qwen3_spec_from_config(const nlohmann::json& cfg, const std::string& where) {
  ModelSpec s;
  s.arch = Arch::Qwen3;
  s.architecture = "Qwen3ForCausalLM";
  s.model_type = "qwen3";
  hf::read_dense_fields(cfg, s, hf::DenseDefaults{.derive_head_shape = false}, where);
  if (auto it = cfg.find("layer_types"); it != cfg.end() && it->is_array())
    for (const auto& t : *it)
      if (t != "full_attention")
        throw std::runtime_error(where + ": layer type " + t.dump() + " is not supported for Qwen3 (only full_attention)");
  s.layer_types.assign(size_t(s.num_hidden_layers), LayerKind::Attention);
  return s;
}

}  // namespace dflash
