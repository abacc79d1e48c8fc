#include "models/drafter_config.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "text/tokenizer.h"

namespace dflash {

std::vector<int64_t> default_target_layer_ids(int64_t L, int64_t n) {
  if (L <= 0 || n <= 0) throw std::invalid_argument("default_target_layer_ids: need layers > 0 and taps > 0");
  if (n == 1) return {L / 2};
  if (L < 4) throw std::invalid_argument("default_target_layer_ids: a target needs at least 4 layers for several taps");
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    const double x = 1.0 + double(i) * double(L - 4) / double(n - 1);
    ids.push_back(int64_t(std::nearbyint(x)));  // FE_TONEAREST: half to even, as Python's round()
  }
  return ids;
}

int64_t default_mask_token_id(const ModelSpec& target, const Tokenizer& tok) {
  if (auto id = tok.token_to_id("<|MASK|>")) return *id;
  if (target.vocab_size > tok.vocab_size()) return tok.vocab_size();  // first spare embedding row
  const std::string& tmpl = tok.chat_template();
  for (int64_t id = tok.vocab_size() - 1; id >= 0; --id) {
    if (!tok.is_special(int32_t(id)) || id == tok.bos_id().value_or(-1) || id == tok.eos_id().value_or(-1)) continue;
    if (tmpl.find(tok.id_to_token(int32_t(id))) != std::string::npos) continue;
    return id;
  }
  throw std::runtime_error("no mask token: the tokenizer has no <|MASK|>, the target no spare embedding row and no "
                           "unused special token exists; pass --mask-token-id");
}

void resolve_mask_token_id(DrafterConfig& c, const Tokenizer& tok, const std::string& where) {
  if (c.mask_token_id >= 0) return;
  const std::optional<int32_t> id = tok.token_to_id("<|MASK|>");
  if (!id)
    throw std::runtime_error(where + ": dflash_config.mask_token_id is missing and the tokenizer has no <|MASK|>; "
                             "give the id with --mask-token-id");
  if (*id >= c.vocab_size)
    throw std::runtime_error(where + ": <|MASK|> (" + std::to_string(*id) + ") is outside the vocabulary");
  c.mask_token_id = *id;
}

void DrafterConfig::validate(const std::string& where) const {
  auto fail = [&](const std::string& m) { throw std::runtime_error(where + ": " + m); };
  for (auto [v, name] : {std::pair{hidden_size, "hidden_size"}, {intermediate_size, "intermediate_size"},
                         {num_hidden_layers, "num_hidden_layers"}, {num_attention_heads, "num_attention_heads"},
                         {num_key_value_heads, "num_key_value_heads"}, {head_dim, "head_dim"},
                         {vocab_size, "vocab_size"}, {num_target_layers, "num_target_layers"}}) {
    if (v <= 0 || v > (int64_t(1) << 24)) fail(std::string(name) + " must be in [1, 2^24] (got " + std::to_string(v) + ")");
  }
  if (num_attention_heads % num_key_value_heads) fail("num_attention_heads is not a multiple of num_key_value_heads");
  if (head_dim % 2) fail("head_dim must be even (RoPE)");
  if (block_size < 2) fail("block_size must be at least 2");
  if (target_layer_ids.empty()) fail("target_layer_ids is empty");
  for (int64_t id : target_layer_ids)
    if (id < 0 || id >= num_target_layers)
      fail("target layer id " + std::to_string(id) + " is outside the target's " + std::to_string(num_target_layers) +
           " layers");
  if (mask_token_id < -1 || mask_token_id >= vocab_size)
    fail("mask_token_id " + std::to_string(mask_token_id) + " is outside the vocabulary [0, " +
         std::to_string(vocab_size) + ")");
  if (int64_t(layer_types.size()) != num_hidden_layers)
    fail("layer_types has " + std::to_string(layer_types.size()) + " entries for " + std::to_string(num_hidden_layers) +
         " layers");
  for (const auto& t : layer_types) {
    if (t != "full_attention" && t != "sliding_attention") fail("unknown layer type '" + t + "'");
    if (t == "sliding_attention" && sliding_window <= 0) fail("sliding_attention layers need sliding_window > 0");
  }
  if (!(rope_theta > 0) || !(rms_norm_eps > 0)) fail("rope_theta and rms_norm_eps must be positive");
}

DrafterConfig derive_drafter_config(const ModelSpec& t, const Tokenizer* tok, const DrafterOverrides& o) {
  DrafterConfig c;
  c.hidden_size = t.hidden_size;
  // A mixture-of-experts target without a dense MLP (Qwen3.5-MoE): 3 x hidden, the dense ratio of Qwen3.
  c.intermediate_size = o.intermediate_size.value_or(t.intermediate_size > 0 ? t.intermediate_size : 3 * t.hidden_size);
  c.num_hidden_layers = o.num_hidden_layers.value_or(5);
  const bool hybrid = t.arch == Arch::Qwen3_5;  // published Qwen3.5/3.6 drafters: 32 / 8 / 128
  c.num_attention_heads = o.num_attention_heads.value_or(hybrid ? 32 : t.num_attention_heads);
  c.num_key_value_heads = o.num_key_value_heads.value_or(hybrid ? 8 : t.num_key_value_heads);
  c.head_dim = o.head_dim.value_or(hybrid ? 128 : t.head_dim);
  c.rope_theta = o.rope_theta.value_or(t.rope.theta);
  c.rms_norm_eps = t.rms_norm_eps;
  c.vocab_size = t.vocab_size;
  c.max_position_embeddings = t.max_position_embeddings;
  c.block_size = o.block_size.value_or(16);
  c.num_target_layers = t.num_hidden_layers;
  if (o.target_layer_ids) {
    c.target_layer_ids = *o.target_layer_ids;
    for (size_t i = 1; i < c.target_layer_ids.size(); ++i)
      if (c.target_layer_ids[i] <= c.target_layer_ids[i - 1])
        throw std::invalid_argument("target layer ids must be strictly increasing (got " +
                                    std::to_string(c.target_layer_ids[i - 1]) + " then " +
                                    std::to_string(c.target_layer_ids[i]) + ")");
  } else {
    const int64_t n = o.num_taps.value_or(5);
    if (n > 1 && t.num_hidden_layers < 4)
      throw std::invalid_argument(std::to_string(n) + " taps need a target of at least 4 layers (this one has " +
                                  std::to_string(t.num_hidden_layers) + "): use --num-taps 1 or --target-layer-ids");
    c.target_layer_ids = default_target_layer_ids(t.num_hidden_layers, n);
  }
  if (o.mask_token_id) c.mask_token_id = *o.mask_token_id;
  else if (tok) c.mask_token_id = default_mask_token_id(t, *tok);
  else throw std::invalid_argument("derive_drafter_config: a tokenizer or an explicit mask token id is needed");
  c.sliding_window = o.sliding_window.value_or(0);
  c.layer_types.assign(size_t(c.num_hidden_layers), "full_attention");
  for (int64_t i : o.sliding_layers) {
    if (i < 0 || i >= c.num_hidden_layers) throw std::invalid_argument("sliding layer " + std::to_string(i) + " does not exist");
    c.layer_types[size_t(i)] = "sliding_attention";
  }
  c.validate("drafter config");
  return c;
}

nlohmann::json drafter_config_to_json(const DrafterConfig& c) {
  bool sliding = false;
  for (const auto& t : c.layer_types) sliding = sliding || t == "sliding_attention";
  return {{"architectures", {"DFlashDraftModel"}},
          {"model_type", "qwen3"},
          {"block_size", c.block_size},
          {"num_target_layers", c.num_target_layers},
          {"num_hidden_layers", c.num_hidden_layers},
          {"dflash_config", {{"mask_token_id", c.mask_token_id}, {"target_layer_ids", c.target_layer_ids}}},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads},
          {"head_dim", c.head_dim},
          {"rope_theta", c.rope_theta},
          {"rms_norm_eps", c.rms_norm_eps},
          {"vocab_size", c.vocab_size},
          {"layer_types", c.layer_types},
          {"sliding_window", sliding ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr)},
          {"use_sliding_window", sliding},
          {"tie_word_embeddings", false},
          {"max_position_embeddings", c.max_position_embeddings},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"torch_dtype", "bfloat16"}};
}

DrafterConfig drafter_config_from_json(const nlohmann::json& j, const std::string& where) {
  auto fail = [&](const std::string& m) { throw std::runtime_error(where + ": " + m); };
  auto req = [&](const nlohmann::json& o, const char* k) -> int64_t {
    if (!o.contains(k) || !o[k].is_number_integer()) fail(std::string("field '") + k + "' is missing or not an integer");
    return o[k].get<int64_t>();
  };
  if (!j.is_object()) fail("config must be a JSON object");
  if (!j.contains("dflash_config") || !j["dflash_config"].is_object()) fail("not a DFlash config: no 'dflash_config'");
  const auto& d = j["dflash_config"];
  DrafterConfig c;
  c.hidden_size = req(j, "hidden_size");
  c.intermediate_size = req(j, "intermediate_size");
  c.num_hidden_layers = req(j, "num_hidden_layers");
  c.num_attention_heads = req(j, "num_attention_heads");
  c.num_key_value_heads = j.contains("num_key_value_heads") ? req(j, "num_key_value_heads") : c.num_attention_heads;
  c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null() ? req(j, "head_dim") : c.hidden_size / std::max<int64_t>(1, c.num_attention_heads);
  c.vocab_size = req(j, "vocab_size");
  c.block_size = req(j, "block_size");
  c.num_target_layers = req(j, "num_target_layers");
  // Older z-lab configs leave these out; their loaders then use the tokenizer's <|MASK|> and one
  // tap per draft layer with the default formula (z-lab dflash model/utils.py build_target_layer_ids).
  c.mask_token_id = d.contains("mask_token_id") ? req(d, "mask_token_id") : -1;
  if (!d.contains("target_layer_ids") || d["target_layer_ids"].is_null()) {
    if (c.num_hidden_layers <= 0) fail("num_hidden_layers must be > 0");
    c.target_layer_ids = default_target_layer_ids(c.num_target_layers, c.num_hidden_layers);
  } else {
    if (!d["target_layer_ids"].is_array()) fail("dflash_config.target_layer_ids must be a list");
    for (const auto& x : d["target_layer_ids"]) {
      if (!x.is_number_integer()) fail("dflash_config.target_layer_ids holds a non-integer");
      c.target_layer_ids.push_back(x.get<int64_t>());
    }
  }
  c.rope_theta = j.value("rope_theta", 1e6);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    c.rope_theta = j["rope_parameters"].value("rope_theta", c.rope_theta);
  c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
  if (j.contains("max_position_embeddings") && !j["max_position_embeddings"].is_null())
    c.max_position_embeddings = req(j, "max_position_embeddings");
  if (j.contains("sliding_window") && j["sliding_window"].is_number_integer()) c.sliding_window = j["sliding_window"];
  if (j.contains("layer_types") && j["layer_types"].is_array()) c.layer_types = j["layer_types"].get<std::vector<std::string>>();
  else c.layer_types.assign(size_t(std::max<int64_t>(0, c.num_hidden_layers)), "full_attention");
  c.validate(where);
  return c;
}

}  // namespace dflash
