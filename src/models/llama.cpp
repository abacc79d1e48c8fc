// Llama (transformers models/llama): RMSNorm with a plain weight, full RoPE ("default" or
// "llama3" scaling), GQA causal attention without q/k norms, SwiGLU MLP.
#include "models/hf_config.h"
#include "models/architectures.h"

namespace dflash {

ModelSpec llama_spec_from_config(const nlohmann::json& cfg, const std::string& where) {
  ModelSpec s;
  s.arch = Arch::Llama;
  s.architecture = "LlamaForCausalLM";
  s.model_type = "llama";
  hf::read_dense_fields(cfg, s, hf::DenseDefaults{}, where);
  if (s.rope.partial_rotary_factor != 1.0)
    throw std::runtime_error(where + ": partial_rotary_factor is not used by Llama models");
  s.layer_types.assign(size_t(s.num_hidden_layers), LayerKind::Attention);
  return s;
}

}  // namespace dflash
