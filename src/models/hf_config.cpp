#include "models/hf_config.h"

#include "io/json_file.h"

#include "models/architectures.h"
#include <stdexcept>

namespace dflash {

namespace hf {

int64_t req_int(const nlohmann::json& cfg, const char* key, const std::string& where) {
  auto it = cfg.find(key);
  if (it == cfg.end() || !it->is_number_integer())
    throw std::runtime_error(where + ": field '" + key + "' is missing or not an integer");
  return it->get<int64_t>();
}

namespace {
double num_req(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) throw std::runtime_error(where + ": rope field '" + key + "' is missing or not a number");
  return it->get<double>();
}

double num_or(const nlohmann::json& j, const char* key, double dflt, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_number()) throw std::runtime_error(where + ": field '" + key + "' must be a number");
  return it->get<double>();
}

bool bool_or(const nlohmann::json& j, const char* key, bool dflt, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) throw std::runtime_error(where + ": field '" + key + "' must be true or false");
  return it->get<bool>();
}
}  // namespace

void read_rope(const nlohmann::json& cfg, RopeSpec& rope, const DenseDefaults& d, const std::string& where) {
  // transformers 5 writes rope_parameters {rope_type, rope_theta, partial_rotary_factor, ...};
  // older files have rope_theta / partial_rotary_factor at the top and rope_scaling.
  nlohmann::json rp = nlohmann::json::object();
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = cfg.find(key);
    if (it != cfg.end() && it->is_object()) rp.update(*it);
    else if (it != cfg.end() && !it->is_null()) throw std::runtime_error(where + ": '" + key + "' must be an object");
  }
  std::string type = "default";
  for (const char* key : {"type", "rope_type"})  // "type": the older spelling
    if (rp.contains(key)) {
      if (!rp[key].is_string()) throw std::runtime_error(where + ": rope field '" + key + "' must be a string");
      type = rp[key].get<std::string>();
    }
  rope.type = type;
  rope.theta = num_or(rp, "rope_theta", num_or(cfg, "rope_theta", d.rope_theta, where), where);
  rope.partial_rotary_factor =
      num_or(rp, "partial_rotary_factor", num_or(cfg, "partial_rotary_factor", d.partial_rotary_factor, where), where);
  if (type == "llama3") {  // transformers requires all four fields for llama3 scaling
    rope.factor = num_req(rp, "factor", where);
    rope.low_freq_factor = num_req(rp, "low_freq_factor", where);
    rope.high_freq_factor = num_req(rp, "high_freq_factor", where);
    rope.original_max_position_embeddings = req_int(rp, "original_max_position_embeddings", where);
    if (!(rope.factor > 0) || !(rope.high_freq_factor > rope.low_freq_factor) || rope.original_max_position_embeddings <= 0)
      throw std::runtime_error(where + ": llama3 rope scaling needs factor > 0, high_freq_factor > low_freq_factor and "
                               "original_max_position_embeddings > 0");
  } else if (type == "yarn") {  // transformers _compute_yarn_parameters: factor required, the rest optional
    rope.factor = num_req(rp, "factor", where);
    // without its own pretrained length, the model's max_position_embeddings (transformers' fallback)
    rope.original_max_position_embeddings =
        rp.contains("original_max_position_embeddings") && !rp["original_max_position_embeddings"].is_null()
            ? req_int(rp, "original_max_position_embeddings", where)
            : req_int(cfg, "max_position_embeddings", where);
    rope.beta_fast = num_or(rp, "beta_fast", 32.0, where);
    rope.beta_slow = num_or(rp, "beta_slow", 1.0, where);
    rope.attention_factor = num_or(rp, "attention_factor", 0.0, where);
    rope.mscale = num_or(rp, "mscale", 0.0, where);
    rope.mscale_all_dim = num_or(rp, "mscale_all_dim", 0.0, where);
    rope.truncate = bool_or(rp, "truncate", true, where);
    if (!(rope.factor >= 1) || rope.original_max_position_embeddings <= 0 || !(rope.beta_fast > 0) ||
        !(rope.beta_slow > 0) || rope.attention_factor < 0)
      throw std::runtime_error(where + ": yarn rope scaling needs factor >= 1, original_max_position_embeddings > 0, "
                               "beta_fast / beta_slow > 0 and attention_factor >= 0");
  } else if (type != "default") {
    throw std::runtime_error(where + ": rope type '" + type + "' is not supported (supported: default, llama3, yarn)");
  }
  if (!(rope.theta > 0)) throw std::runtime_error(where + ": rope_theta must be positive");
}

namespace {
// Fails for features the engine does not implement (attention_bias, mlp_bias, sliding windows).
void reject_unsupported(const nlohmann::json& cfg, const std::string& where) {
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (cfg.value(key, false)) throw std::runtime_error(where + ": '" + key + "': true is not supported");
  if (cfg.value("use_sliding_window", false))
    throw std::runtime_error(where + ": sliding-window targets (use_sliding_window: true) are not supported");
}

}  // namespace

void read_dense_fields(const nlohmann::json& cfg, ModelSpec& s, const DenseDefaults& d, const std::string& where) {
  if (!cfg.is_object()) throw std::runtime_error(where + ": config must be a JSON object");
  s.vocab_size = req_int(cfg, "vocab_size", where);
  s.hidden_size = req_int(cfg, "hidden_size", where);
  // Qwen3.5-MoE configs have no dense MLP size (every layer is a mixture of experts).
  if (!d.intermediate_optional || (cfg.contains("intermediate_size") && !cfg["intermediate_size"].is_null()))
    s.intermediate_size = req_int(cfg, "intermediate_size", where);
  s.num_hidden_layers = req_int(cfg, "num_hidden_layers", where);
  s.num_attention_heads = req_int(cfg, "num_attention_heads", where);
  if (!d.derive_head_shape) {
    s.num_key_value_heads = req_int(cfg, "num_key_value_heads", where);
    s.head_dim = req_int(cfg, "head_dim", where);
  } else {
    s.num_key_value_heads = cfg.contains("num_key_value_heads") && !cfg["num_key_value_heads"].is_null()
                                ? req_int(cfg, "num_key_value_heads", where)
                                : s.num_attention_heads;
    if (cfg.contains("head_dim") && !cfg["head_dim"].is_null()) s.head_dim = req_int(cfg, "head_dim", where);
    else if (s.num_attention_heads > 0) s.head_dim = s.hidden_size / s.num_attention_heads;
  }
  s.rms_norm_eps = num_or(cfg, "rms_norm_eps", 1e-6, where);
  if (cfg.contains("max_position_embeddings") && !cfg["max_position_embeddings"].is_null())
    s.max_position_embeddings = req_int(cfg, "max_position_embeddings", where);
  s.hidden_act = cfg.value("hidden_act", std::string("silu"));
  if (cfg.contains("tie_word_embeddings")) s.tie_word_embeddings = cfg["tie_word_embeddings"].get<bool>();
  if (cfg.contains("bos_token_id") && cfg["bos_token_id"].is_number_integer()) s.bos_token_id = cfg["bos_token_id"];
  if (auto it = cfg.find("eos_token_id"); it != cfg.end()) {
    if (it->is_number_integer()) s.eos_token_ids = {it->get<int64_t>()};
    else if (it->is_array())
      for (const auto& e : *it) {
        if (!e.is_number_integer()) throw std::runtime_error(where + ": eos_token_id holds a non-integer");
        s.eos_token_ids.push_back(e.get<int64_t>());
      }
  }
  read_rope(cfg, s.rope, d, where);
  // (The targets' forward passes have no cos / sin scale: yarn is read for drafters only.)
  if (s.rope.type == "yarn")
    throw std::runtime_error(where + ": a target with yarn rope scaling is not supported (rope_type 'yarn'; drafters "
                             "with yarn are)");
  reject_unsupported(cfg, where);
}

}  // namespace hf

ModelSpec model_spec_from_hf_config(const nlohmann::json& cfg, const std::string& where) {
  if (!cfg.is_object()) throw std::runtime_error(where + ": config must be a JSON object");
  std::string arch;
  if (auto it = cfg.find("architectures"); it != cfg.end() && it->is_array() && !it->empty() && (*it)[0].is_string())
    arch = (*it)[0].get<std::string>();
  const std::string mt = cfg.value("model_type", std::string());
  ModelSpec s;
  try {
    if (arch == "LlamaForCausalLM" || (arch.empty() && mt == "llama")) s = llama_spec_from_config(cfg, where);
    else if (arch == "Qwen3ForCausalLM" || (arch.empty() && mt == "qwen3")) s = qwen3_spec_from_config(cfg, where);
    else if (arch == "Qwen3_5ForCausalLM" || arch == "Qwen3_5ForConditionalGeneration" ||
             arch == "Qwen3_5MoeForCausalLM" || arch == "Qwen3_5MoeForConditionalGeneration" ||
             arch == "Qwen3NextForCausalLM" ||
             (arch.empty() && (mt == "qwen3_5" || mt == "qwen3_5_text" || mt == "qwen3_5_moe" ||
                               mt == "qwen3_5_moe_text" || mt == "qwen3_next")))
      s = qwen3_5_spec_from_config(cfg, where);
    else
      throw std::runtime_error(where + ": unsupported architecture '" + (arch.empty() ? "model_type " + mt : arch) +
                               "'; supported: " + kSupportedArchitectures);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + ": malformed field: " + e.what());
  }
  s.validate(where);
  return s;
}

ModelSpec load_hf_config(const std::string& path) {
  return model_spec_from_hf_config(read_json_file(path), path);
}

}  // namespace dflash
