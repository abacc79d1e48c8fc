// Hugging Face config.json -> ModelSpec. Each architecture's own fields are read by its file in
// src/models/ (llama.cpp, qwen3.cpp, qwen3_5.cpp); the shared dense fields are read here.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "models/model_spec.h"

namespace dflash {

/// Architectures accepted in config.json "architectures" (also used in error messages).
inline constexpr const char* kSupportedArchitectures =
    "LlamaForCausalLM, Qwen3ForCausalLM, Qwen3_5ForCausalLM (model_type qwen3_5_text), "
    "Qwen3_5ForConditionalGeneration (model_type qwen3_5), Qwen3_5MoeForCausalLM (qwen3_5_moe_text), "
    "Qwen3_5MoeForConditionalGeneration (qwen3_5_moe), Qwen3NextForCausalLM (qwen3_next)";

/// Reads `path` (a config.json) into a validated ModelSpec. Throws std::runtime_error naming the
/// file and the offending field; an unknown architecture lists the supported ones.
ModelSpec load_hf_config(const std::string& path);
/// Same from already parsed JSON; `where` names the source in errors.
ModelSpec model_spec_from_hf_config(const nlohmann::json& cfg, const std::string& where);

namespace hf {
/// What a family assumes when config.json leaves a field out.
struct DenseDefaults {
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;
  /// Llama derives head_dim = hidden / heads and kv heads = heads; the Qwen families' classes have
  /// other defaults, so their configs must state both fields (a clear error otherwise).
  bool derive_head_shape = true;
  /// intermediate_size may be absent (left 0): models whose every layer is a mixture of experts.
  bool intermediate_optional = false;
};
/// Shared dense fields (sizes, heads, head_dim, eps, rope, bos/eos, tie_word_embeddings, act)
/// from one config object (the text_config for wrappers).
void read_dense_fields(const nlohmann::json& cfg, ModelSpec& spec, const DenseDefaults& d, const std::string& where);
/// RoPE of one config object: rope_scaling / rope_parameters (rope_type or type: default, llama3,
/// yarn) and rope_theta / partial_rotary_factor there or at the top level. Throws std::runtime_error
/// naming `where` and the field for a missing scaling field or an unsupported type.
void read_rope(const nlohmann::json& cfg, RopeSpec& rope, const DenseDefaults& d, const std::string& where);
/// Integer field that must be present.
int64_t req_int(const nlohmann::json& cfg, const char* key, const std::string& where);
}  // namespace hf

}  // namespace dflash
