#include "models/drafter_config.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "models/hf_config.h"
#include "ops/rope.h"
#include "text/tokenizer.h"

namespace dflash {

std::vector<int64_t> default_target_layer_ids(int64_t L, int64_t n) {
  if (L <= 0 || n <= 0) throw std::invalid_argument("default_target_layer_ids: need layers > 0 and taps > 0");
  if (L < 2) throw std::invalid_argument("default_target_layer_ids: a target of one layer has no layer to tap but its last");
  if (n == 1) return {L == 2 ? 0 : L / 2};  // (L / 2 is the last layer of a 2-layer target)
  if (L < 4) throw std::invalid_argument("default_target_layer_ids: a target needs at least 4 layers for several taps");
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    const double x = 1.0 + double(i) * double(L - 4) / double(n - 1);
    ids.push_back(int64_t(std::nearbyint(x)));  // FE_TONEAREST: half to even, as Python's round()
    if (i > 0 && ids[size_t(i)] == ids[size_t(i) - 1])
      throw std::invalid_argument("default_target_layer_ids: " + std::to_string(n) + " taps of a " + std::to_string(L) +
                                  "-layer target would tap layer " + std::to_string(ids.back()) +
                                  " twice: use at most " + std::to_string(L - 3) + " taps (--num-taps)");
  }
  return ids;
}

namespace {
/// Ids that end a sequence or a turn: chat_stop_tokens with the tokenizer's own chat family; the EOS
/// ids alone without a tokenizer or for a template of no known family.
std::vector<int64_t> stop_ids(const ModelSpec& target, const Tokenizer* tok) {
  std::vector<int64_t> r = target.eos_token_ids;
  if (!tok) return r;
  if (auto e = tok->eos_id()) r.push_back(*e);
  if (tok->chat_template().empty()) return r;
  try {
    return chat_stop_tokens(target, *tok, detect_chat_family(tok->chat_template()));
  } catch (const std::runtime_error&) {  // a template of no known family
    return r;
  }
}

bool is_stop(int64_t id, const std::vector<int64_t>& stops) {
  return std::find(stops.begin(), stops.end(), id) != stops.end();
}

/// The published Qwen3.5 / 3.6 drafters' mask token: <|audio_start|> of the Qwen3.5 tokenizer, a
/// special token no text chat writes.
constexpr int64_t kQwen35MaskTokenId = 248070;
}  // namespace

std::vector<int64_t> chat_stop_tokens(const ModelSpec& target, const Tokenizer& tok, ChatFamily family) {
  std::vector<int64_t> r = target.eos_token_ids;
  if (auto e = tok.eos_id()) r.push_back(*e);
  if (auto e = tok.token_to_id(end_of_turn_token(family))) r.push_back(*e);
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

void check_drafter_fits(const DrafterConfig& d, const ModelSpec& t, const std::string& path) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(path + ": this drafter does not fit the target " + t.architecture + ": " + why);
  };
  if (d.hidden_size != t.hidden_size)
    fail("hidden_size " + std::to_string(d.hidden_size) + " vs the target's " + std::to_string(t.hidden_size));
  if (d.vocab_size != t.vocab_size)
    fail("vocab_size " + std::to_string(d.vocab_size) + " vs the target's " + std::to_string(t.vocab_size));
  if (d.mask_token_id < 0 || d.mask_token_id >= t.vocab_size)
    fail("mask_token_id " + std::to_string(d.mask_token_id) + " is outside the vocabulary");
  for (int64_t id : d.target_layer_ids)
    if (id < 0 || id >= t.num_hidden_layers)
      fail("target layer id " + std::to_string(id) + " is outside the target's " +
           std::to_string(t.num_hidden_layers) + " layers");
}

void check_mask_token(int64_t id, const ModelSpec& target, const Tokenizer& tok, const std::string& where) {
  if (is_stop(id, stop_ids(target, &tok)))
    throw std::invalid_argument(where + ": mask_token_id " + std::to_string(id) + " (" + tok.id_to_token(int32_t(id)) +
                                ") ends a turn or a sequence for this target: the drafter fills its blocks with it and "
                                "a server would stop there; choose another id");
}

int64_t default_mask_token_id(const ModelSpec& target, const Tokenizer& tok) {
  if (auto id = tok.token_to_id("<|MASK|>")) return *id;
  const std::vector<int64_t> stops = stop_ids(target, &tok);
  const std::string& tmpl = tok.chat_template();
  auto unused_special = [&](int64_t id) {
    return id < tok.vocab_size() && tok.is_special(int32_t(id)) && id != tok.bos_id().value_or(-1) && !is_stop(id, stops) &&
           tmpl.find(tok.id_to_token(int32_t(id))) == std::string::npos;
  };
  if (target.arch == Arch::Qwen3_5 && target.vocab_size > kQwen35MaskTokenId && unused_special(kQwen35MaskTokenId))
    return kQwen35MaskTokenId;
  if (target.vocab_size > tok.vocab_size()) return tok.vocab_size();  // first spare embedding row
  for (int64_t id = tok.vocab_size() - 1; id >= 0; --id)
    if (unused_special(id)) return id;
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
  for (size_t i = 1; i < target_layer_ids.size(); ++i)
    if (target_layer_ids[i] <= target_layer_ids[i - 1])
      fail("target_layer_ids must be strictly increasing (got " + std::to_string(target_layer_ids[i - 1]) + " then " +
           std::to_string(target_layer_ids[i]) + "): servers capture the sorted distinct layers");
  if (target_layer_ids.back() == num_target_layers - 1)
    fail("target layer id " + std::to_string(target_layer_ids.back()) + " is the target's last layer: servers capture "
         "each tapped layer's output as the next layer's input, and there is none after it");
  if (max_position_embeddings <= 0)
    fail("max_position_embeddings must be positive (got " + std::to_string(max_position_embeddings) +
         "): servers size the RoPE cache by it");
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
  if (markov_rank < 0 || markov_rank > (int64_t(1) << 16)) fail("markov_rank must be in [0, 65536] (got " + std::to_string(markov_rank) + ")");
  if (!(rope.theta > 0) || !(rms_norm_eps > 0)) fail("rope_theta and rms_norm_eps must be positive");
  if (rope.partial_rotary_factor != 1.0)
    fail("partial_rotary_factor " + std::to_string(rope.partial_rotary_factor) + ": a DFlash drafter rotates its whole head_dim");
  if (rope.type != "default" && rope.type != "llama3" && rope.type != "yarn")
    fail("rope type '" + rope.type + "' is not supported (default, llama3, yarn)");
  if (rope.type == "yarn") {
    // SGLang and vLLM scale cos / sin by 0.1 ln(factor) + 1 and ignore attention_factor / mscale;
    // transformers before 5 takes the factor from max_position_embeddings / original_max_position_embeddings.
    RopeSpec plain = rope;
    plain.attention_factor = 0, plain.mscale = 0, plain.mscale_all_dim = 0;
    if (std::abs(cpu::rope_attention_factor(rope) - cpu::rope_attention_factor(plain)) > 1e-12)
      fail("rope_scaling: a yarn attention_factor / mscale other than 0.1 ln(factor) + 1 (" +
           std::to_string(cpu::rope_attention_factor(rope)) + "): SGLang and vLLM ignore it and would serve the "
           "drafter with another scale");
    if (std::abs(double(max_position_embeddings) - rope.factor * double(rope.original_max_position_embeddings)) >= 1)
      fail("rope_scaling: yarn factor " + std::to_string(rope.factor) + " x original_max_position_embeddings " +
           std::to_string(rope.original_max_position_embeddings) + " is not max_position_embeddings " +
           std::to_string(max_position_embeddings) + ": transformers versions read the factor differently");
  }
}

std::vector<int64_t> captured_layer_ids(const DrafterConfig& c) {
  std::vector<int64_t> r = c.target_layer_ids;
  if (c.is_dspark()) r.push_back(c.num_target_layers - 1);
  return r;
}

bool DrafterConfig::is_sliding(int64_t layer) const {
  return layer >= 0 && size_t(layer) < layer_types.size() && layer_types[size_t(layer)] == "sliding_attention";
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
  c.rope.theta = o.rope_theta.value_or(t.rope.theta);
  c.rms_norm_eps = t.rms_norm_eps;
  c.vocab_size = t.vocab_size;
  if (t.max_position_embeddings > 0) c.max_position_embeddings = t.max_position_embeddings;
  if (!o.rope_scaling.is_null()) {  // read as config.json's rope_scaling is
    hf::DenseDefaults rd;
    rd.rope_theta = c.rope.theta;
    hf::read_rope({{"rope_scaling", o.rope_scaling}, {"max_position_embeddings", c.max_position_embeddings}}, c.rope,
                  rd, "rope scaling");
  }
  c.markov_rank = o.markov_rank.value_or(0);
  c.block_size = o.block_size.value_or(c.is_dspark() ? 7 : 16);  // DSpark's published block: 7
  c.num_target_layers = t.num_hidden_layers;
  if (o.target_layer_ids) {
    c.target_layer_ids = *o.target_layer_ids;  // (validate: strictly increasing, not the last layer)
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
  if (tok) check_mask_token(c.mask_token_id, t, *tok, "drafter config");
  else if (is_stop(c.mask_token_id, stop_ids(t, nullptr)))
    throw std::invalid_argument("drafter config: mask_token_id " + std::to_string(c.mask_token_id) +
                                " is an EOS id of the target; choose another id");
  c.sliding_window = o.sliding_window.value_or(0);
  if (!o.layer_types.empty()) {
    if (o.num_hidden_layers && *o.num_hidden_layers != int64_t(o.layer_types.size()))
      throw std::invalid_argument("layer types list " + std::to_string(o.layer_types.size()) + " layers, but " +
                                  std::to_string(*o.num_hidden_layers) + " draft layers are asked for");
    c.num_hidden_layers = int64_t(o.layer_types.size());
  }
  c.layer_types = o.layer_types.empty() ? std::vector<std::string>(size_t(c.num_hidden_layers), "full_attention")
                                        : o.layer_types;
  for (int64_t i : o.sliding_layers) {
    if (i < 0 || i >= c.num_hidden_layers) throw std::invalid_argument("sliding layer " + std::to_string(i) + " does not exist");
    c.layer_types[size_t(i)] = "sliding_attention";
  }
  c.validate("drafter config");
  return c;
}

namespace {
/// rope_scaling as transformers reads it (the older key, which transformers 5, SGLang, vLLM and z-lab's
/// MLX loader all take), for a scaled RoPE; null for the default one.
nlohmann::json rope_scaling_json(const RopeSpec& r) {
  if (r.type == "default") return nullptr;
  nlohmann::json j = {{"rope_type", r.type}, {"factor", r.factor},
                      {"original_max_position_embeddings", r.original_max_position_embeddings}};
  if (r.type == "llama3") {
    j["low_freq_factor"] = r.low_freq_factor, j["high_freq_factor"] = r.high_freq_factor;
  } else {  // yarn
    j["beta_fast"] = r.beta_fast, j["beta_slow"] = r.beta_slow;
    if (r.attention_factor > 0) j["attention_factor"] = r.attention_factor;
    if (r.mscale != 0) j["mscale"] = r.mscale;
    if (r.mscale_all_dim != 0) j["mscale_all_dim"] = r.mscale_all_dim;
    if (!r.truncate) j["truncate"] = false;
  }
  return j;
}

bool flag(const nlohmann::json& o, const char* key, const std::string& where) {
  if (!o.contains(key) || o[key].is_null()) return false;
  if (!o[key].is_boolean()) throw std::runtime_error(where + ": field '" + key + "' must be true or false");
  return o[key].get<bool>();
}

/// DSpark's fields as SGLang's parse_dspark_draft_config finds them: the dspark_-prefixed key, then
/// dspark_config, then the top level.
void read_dspark(const nlohmann::json& j, DrafterConfig& c, const std::string& where) {
  auto fail = [&](const std::string& m) { throw std::runtime_error(where + ": " + m); };
  const nlohmann::json none = nlohmann::json::object();
  const nlohmann::json& ds = j.contains("dspark_config") && j["dspark_config"].is_object() ? j["dspark_config"] : none;
  auto find = [&](const char* key) -> const nlohmann::json* {
    const std::string prefixed = std::string("dspark_") + key;
    if (j.contains(prefixed) && !j[prefixed].is_null()) return &j[prefixed];
    if (ds.contains(key) && !ds[key].is_null()) return &ds[key];
    if (j.contains(key) && !j[key].is_null()) return &j[key];
    return nullptr;
  };
  const nlohmann::json* rank = find("markov_rank");
  if (!rank) return;
  if (!rank->is_number_integer() || rank->get<int64_t>() < 0) fail("markov_rank must be a non-negative integer");
  c.markov_rank = rank->get<int64_t>();
  if (!c.is_dspark()) return;
  if (j.value("speculators_model_type", "") == "dspark")
    fail("a DSpark checkpoint in the speculators convention (slot j predicts anchor + j): SGLang refuses it, and "
         "this reader follows DeepSpec's (slot k predicts anchor + k + 1)");
  const nlohmann::json* type = find("markov_head_type");
  const bool prefixed = j.contains("dspark_markov_rank") || j.contains("dspark_block_size");
  if (!type && !prefixed) fail("markov_rank without markov_head_type: SGLang refuses it (it cannot tell the head)");
  if (type && !(type->is_string() && type->get<std::string>() == "vanilla"))
    fail("markov_head_type " + type->dump() + ": only the vanilla Markov head is supported");
  for (const char* key : {"enable_confidence_head", "confidence_head_with_markov"}) {
    const nlohmann::json* v = find(key);
    if (v && !(v->is_boolean() && v->get<bool>()))
      fail(std::string(key) + " " + v->dump() + ": this reader needs the confidence head on [hidden; W1[previous token]]");
  }
}
}  // namespace

nlohmann::json drafter_config_to_json(const DrafterConfig& c) {
  bool sliding = false;
  for (const auto& t : c.layer_types) sliding = sliding || t == "sliding_attention";
  nlohmann::json dflash = {{"mask_token_id", c.mask_token_id}, {"target_layer_ids", c.target_layer_ids}};
  if (c.causal) dflash["causal"] = *c.causal;
  nlohmann::json j = {{"architectures", {c.is_dspark() ? "Qwen3DSparkModel" : "DFlashDraftModel"}},
          {"model_type", "qwen3"},
          {"block_size", c.block_size},
          {"num_target_layers", c.num_target_layers},
          {"num_hidden_layers", c.num_hidden_layers},
          {"dflash_config", dflash},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads},
          {"head_dim", c.head_dim},
          {"rope_theta", c.rope.theta},
          {"rope_scaling", rope_scaling_json(c.rope)},
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
  if (c.is_dspark()) {  // SGLang's parse_dspark_draft_config and vLLM's Qwen3DSparkModel read these at the top level
    j["markov_rank"] = c.markov_rank;
    j["markov_head_type"] = "vanilla";
    j["enable_confidence_head"] = true;
    j["confidence_head_with_markov"] = true;
  }
  return j;
}

DrafterConfig drafter_config_from_json(const nlohmann::json& j, const std::string& where) {
  auto fail = [&](const std::string& m) { throw std::runtime_error(where + ": " + m); };
  auto req = [&](const nlohmann::json& o, const char* k) -> int64_t {
    if (!o.contains(k) || !o[k].is_number_integer()) fail(std::string("field '") + k + "' is missing or not an integer");
    return o[k].get<int64_t>();
  };
  auto has = [](const nlohmann::json& o, const char* k) { return o.contains(k) && !o[k].is_null(); };
  if (!j.is_object()) fail("config must be a JSON object");
  if (!j.contains("dflash_config") || !j["dflash_config"].is_object()) fail("not a DFlash config: no 'dflash_config'");
  const auto& d = j["dflash_config"];
  DrafterConfig c;
  c.hidden_size = req(j, "hidden_size");
  c.intermediate_size = req(j, "intermediate_size");
  c.num_hidden_layers = req(j, "num_hidden_layers");
  c.num_attention_heads = req(j, "num_attention_heads");
  c.num_key_value_heads = j.contains("num_key_value_heads") ? req(j, "num_key_value_heads") : c.num_attention_heads;
  c.head_dim = has(j, "head_dim") ? req(j, "head_dim") : c.hidden_size / std::max<int64_t>(1, c.num_attention_heads);
  c.vocab_size = req(j, "vocab_size");
  // SGLang reads dflash_config.block_size first, z-lab the top level: both, when given, must agree.
  if (!has(d, "block_size") && !has(j, "block_size")) fail("field 'block_size' is missing (top level or dflash_config)");
  c.block_size = has(d, "block_size") ? req(d, "block_size") : req(j, "block_size");
  if (has(d, "block_size") && has(j, "block_size") && req(j, "block_size") != c.block_size)
    fail("block_size " + std::to_string(req(j, "block_size")) + " and dflash_config.block_size " +
         std::to_string(c.block_size) + " differ: servers read one or the other");
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
  hf::DenseDefaults rd;
  rd.rope_theta = 1e6;  // vLLM's default for a drafter without rope_theta
  nlohmann::json rj = j;  // (yarn's pretrained length falls back to max_position_embeddings, default 32768)
  if (!has(rj, "max_position_embeddings")) rj["max_position_embeddings"] = c.max_position_embeddings;
  hf::read_rope(rj, c.rope, rd, where);
  for (const char* key : {"rope_scaling", "rope_parameters"})  // the servers' own yarn knobs, which transformers lacks
    if (j.contains(key) && j[key].is_object())
      for (const char* knob : {"attn_factor", "extrapolation_factor"})
        if (j[key].contains(knob) && !(j[key][knob].is_number() && j[key][knob].get<double>() == 1.0))
          fail(std::string(key) + "." + knob + " " + j[key][knob].dump() +
               ": the servers read it and transformers does not; only 1 is served alike");
  c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
  if (j.contains("max_position_embeddings") && !j["max_position_embeddings"].is_null())
    c.max_position_embeddings = req(j, "max_position_embeddings");
  // transformers' Qwen3Config keeps sliding_window only with use_sliding_window, and without
  // layer_types makes layers from max_window_layers on sliding (when a window is kept).
  const bool use_sliding = flag(j, "use_sliding_window", where);
  if (use_sliding && has(j, "sliding_window")) c.sliding_window = req(j, "sliding_window");
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    c.layer_types = j["layer_types"].get<std::vector<std::string>>();
  } else {
    const int64_t first_sliding = has(j, "max_window_layers") ? req(j, "max_window_layers") : 28;
    for (int64_t i = 0; i < std::max<int64_t>(0, c.num_hidden_layers); ++i)
      c.layer_types.push_back(c.sliding_window > 0 && i >= first_sliding ? "sliding_attention" : "full_attention");
  }
  // vLLM: dflash_config.use_swa makes every layer sliding when layer_types has none, and a sliding
  // layer's window is dflash_config.swa_window_size before sliding_window.
  if (flag(d, "use_swa", where) && std::find(c.layer_types.begin(), c.layer_types.end(), "sliding_attention") == c.layer_types.end())
    c.layer_types.assign(c.layer_types.size(), "sliding_attention");
  if (has(d, "swa_window_size")) c.sliding_window = req(d, "swa_window_size");
  // is_causal, else dflash_config.causal, sets every layer's causality (vLLM).
  for (const auto* o : {&d, &j}) {
    const char* key = o == &j ? "is_causal" : "causal";
    if (has(*o, key)) c.causal = flag(*o, key, where);
  }
  if (flag(d, "attention_sink_bias", where)) fail("dflash_config.attention_sink_bias (attention sinks) is not supported");
  read_dspark(j, c, where);
  c.validate(where);
  return c;
}

}  // namespace dflash
