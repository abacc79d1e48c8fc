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
    "Qwen3_5ForConditionalGeneration (model_type qwen3_5)";

/// Reads `path` (a config.json) into a validated ModelSpec. Throws std::runtime_error naming the
/// file and the offending field; an unknown architecture lists the supported ones.
ModelSpec load_hf_config(const std::string& path);
/// Same from already parsed JSON; `where` names the source in errors.
ModelSpec model_spec_from_hf_config(const nlohmann::json& cfg, const std::string& where);

namespace hf {
/// Shared dense fields (sizes, heads, head_dim, eps, rope, bos/eos, tie_word_embeddings, act)
/// from one config object (the text_config for wrappers). `default_theta` when the file has none.
void read_dense_fields(const nlohmann::json& cfg, ModelSpec& spec, double default_theta, const std::string& where);
/// Integer field that must be present.
int64_t req_int(const nlohmann::json& cfg, const char* key, const std::string& where);
/// Fails for features the engine does not implement yet (attention_bias, mlp_bias, sliding windows).
void reject_unsupported(const nlohmann::json& cfg, const std::string& where);
}  // namespace hf

// Per-architecture readers (src/models/{llama,qwen3,qwen3_5}.cpp).
ModelSpec llama_spec_from_config(const nlohmann::json& cfg, const std::string& where);
ModelSpec qwen3_spec_from_config(const nlohmann::json& cfg, const std::string& where);
/// Accepts both Qwen3_5ForCausalLM (fields at top level) and Qwen3_5ForConditionalGeneration
/// (fields in text_config, weights under model.language_model.*).
ModelSpec qwen3_5_spec_from_config(const nlohmann::json& cfg, const std::string& where);

}  // namespace dflash
