// Per-architecture config readers, one file each: src/models/{llama,qwen3,qwen3_5}.cpp.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "models/model_spec.h"

namespace dflash {

/// config.json of a LlamaForCausalLM -> spec. Throws std::runtime_error prefixed by `where`.
ModelSpec llama_spec_from_config(const nlohmann::json& cfg, const std::string& where);
/// config.json of a Qwen3ForCausalLM -> spec.
ModelSpec qwen3_spec_from_config(const nlohmann::json& cfg, const std::string& where);
/// Accepts both Qwen3_5ForCausalLM (fields at top level) and Qwen3_5ForConditionalGeneration
/// (fields in text_config, weights under model.language_model.*).
ModelSpec qwen3_5_spec_from_config(const nlohmann::json& cfg, const std::string& where);

}  // namespace dflash
