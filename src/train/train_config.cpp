#include "train/train_config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <stdexcept>

namespace dflash {

double default_gamma(int64_t B) {
  if (B == 16) return 7.0;
  if (B == 10) return 5.0;
  if (B == 8) return 4.0;
  return 7.0 * double(B) / 16.0;
}

void TrainConfig::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("train config: " + what);
  };
  need(!target.empty(), "target is required (--target)");
  need(!data.empty(), "data is required (--data)");
  need(!out.empty(), "out is required (--out)");
  validate_values();
}

void TrainConfig::validate_values() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("train config: " + what);
  };
  need(device == "cpu" || device == "cuda", "device must be cpu or cuda (got " + device + ")");
  need(target_gpus.empty() == drafter_gpus.empty(), "target_gpus and drafter_gpus go together (set both, or gpus)");
  for (const auto& [name, l] : {std::pair<const char*, const std::vector<int>*>{"gpus", &gpus},
                                {"target_gpus", &target_gpus}, {"drafter_gpus", &drafter_gpus}}) {
    need(!l->empty() || std::string(name) != "gpus", "gpus must name at least one CUDA device");
    for (size_t i = 0; i < l->size(); ++i) {
      need((*l)[i] >= 0, std::string(name) + " must be >= 0");
      for (size_t j = 0; j < i; ++j)
        need((*l)[i] != (*l)[j], std::string(name) + " lists device " + std::to_string((*l)[i]) + " twice");
    }
  }
  need(!mask_token_id || *mask_token_id >= 0, "mask_token_id must be >= 0");
  need(layer_types.empty() || int64_t(layer_types.size()) == num_draft_layers,
       "layer_types lists " + std::to_string(layer_types.size()) + " layers but num_draft_layers is " +
           std::to_string(num_draft_layers));
  for (const std::string& t : layer_types)
    need(t == "full_attention" || t == "sliding_attention",
         "layer_types: unknown type '" + t + "' (full_attention, sliding_attention)");
  need(sliding_window >= 0, "sliding_window must be >= 0");
  for (const auto& [v, name] : {std::pair{&num_attention_heads, "num_attention_heads"},
                                {&num_key_value_heads, "num_key_value_heads"}, {&head_dim, "head_dim"},
                                {&intermediate_size, "intermediate_size"}})
    need(!*v || **v >= 1, std::string(name) + " must be >= 1");
  need(rope_scaling.is_null() || rope_scaling.is_object(), "rope_scaling must be null or an object");
  need(max_length >= 2, "max_length must be >= 2");
  need(num_draft_layers >= 1, "num_draft_layers must be >= 1");
  need(num_taps >= 1, "num_taps must be >= 1");
  need(block_size == 0 || (block_size >= 2 && block_size <= 64),
       "block_size must be in [2, 64] (published drafters: DFlash 16, DSpark 7; 0: by the drafter)");
  need(drafter_type.empty() || drafter_type == "dflash" || drafter_type == "dspark", "drafter_type must be dflash or dspark (got " + drafter_type + ")");
  need(markov_rank >= 1 && markov_rank <= 65536, "markov_rank must be in [1, 65536]");
  need(!(drafter_type == "dspark" && loss == "dpace"), "loss dpace weighs a DFlash drafter's slots; DSpark has its own loss");
  need((epochs >= 1 && epochs <= 100000) || max_steps > 0, "epochs must be in [1, 100000] (or set max_steps)");
  for (int64_t id : target_layer_ids) need(id >= 0, "target_layer_ids must be >= 0");
  need(max_steps >= 0, "max_steps must be >= 0");
  need(grad_accum >= 1, "grad_accum must be >= 1");
  need(target_batch_tokens >= 1, "target_batch_tokens must be >= 1");
  need(target_dtype == "bf16" || target_dtype == "fp8", "target_dtype must be bf16 or fp8 (got " + target_dtype + ")");
  need(target_dtype == "bf16" || device == "cuda", "target_dtype fp8 runs on the GPU only (device cuda)");
  need(num_anchors >= 1, "num_anchors must be >= 1");
  need(lr > 0 && std::isfinite(lr), "lr must be > 0");
  need(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "beta1 and beta2 must be in [0, 1)");
  need(eps > 0 && std::isfinite(eps), "eps must be > 0");
  need(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay must be >= 0");
  need(warmup_ratio >= 0 && warmup_ratio <= 1, "warmup_ratio must be in [0, 1]");
  need(max_grad_norm > 0, "max_grad_norm must be > 0");
  need(gamma >= 0, "gamma must be >= 0 (0 = by block size)");
  need(loss == "dflash" || loss == "dpace", "loss must be dflash or dpace (got " + loss + ")");
  need(save_every >= 1 && keep_last >= 1 && log_every >= 1 && stages_every >= 1 && nan_abort >= 1,
       "save_every, keep_last, log_every, stages_every and nan_abort must be >= 1");
  need(steps_this_run >= 0, "steps_this_run must be >= 0");
  need(eval_every >= 0 && eval_limit >= 0, "eval_every and eval_limit must be >= 0");
  need(eval_every == 0 || !eval_data.empty(), "eval_every needs eval_data (the held-out prompt files)");
  need(eval_max_new_tokens >= 1 && eval_batch_size >= 1, "eval_max_new_tokens and eval_batch_size must be >= 1");
}

std::vector<std::string> parse_layer_types(const std::string& s) {
  std::vector<std::string> r;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t end = std::min(s.find(',', at), s.size());
    std::string item = s.substr(at, end - at);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    int64_t n = 1;
    if (const size_t x = item.find(" x"); x != std::string::npos) {
      const std::string count = item.substr(x + 2);
      if (count.empty() || count.find_first_not_of("0123456789") != std::string::npos || count.size() > 3 ||
          std::stoll(count) < 1)
        throw std::invalid_argument("layer types: '" + item + "': the count after x must be a number from 1 to 999");
      n = std::stoll(count);
      item.erase(x);
    }
    if (item != "full_attention" && item != "sliding_attention")
      throw std::invalid_argument("layer types: unknown type '" + item + "' (full_attention, sliding_attention; "
                                  "e.g. \"sliding_attention x4,full_attention\")");
    r.insert(r.end(), size_t(n), item);
    at = end + 1;
  }
  return r;
}

namespace {
nlohmann::json optional_json(const std::optional<int64_t>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }
std::optional<int64_t> optional_int(const nlohmann::json& v) {
  return v.is_null() ? std::nullopt : std::optional<int64_t>(v.get<int64_t>());
}
}  // namespace

nlohmann::json to_json(const TrainConfig& c) {
  return {{"target", c.target},
          {"data", c.data},
          {"out", c.out},
          {"tokenizer", c.tokenizer},
          {"chat_template", c.chat_template},
          {"device", c.device},
          {"gpus", c.gpus},
          {"target_gpus", c.target_gpus},
          {"drafter_gpus", c.drafter_gpus},
          {"target_batch_tokens", c.target_batch_tokens},
          {"target_dtype", c.target_dtype},
          {"init_from", c.init_from},
          {"max_length", c.max_length},
          {"shuffle", c.shuffle},
          {"seed", c.seed},
          {"drafter_type", c.drafter_type},
          {"markov_rank", c.markov_rank},
          {"num_draft_layers", c.num_draft_layers},
          {"num_taps", c.num_taps},
          {"block_size", c.block_size},
          {"target_layer_ids", c.target_layer_ids},
          {"mask_token_id", optional_json(c.mask_token_id)},
          {"layer_types", c.layer_types},
          {"sliding_window", c.sliding_window},
          {"num_attention_heads", optional_json(c.num_attention_heads)},
          {"num_key_value_heads", optional_json(c.num_key_value_heads)},
          {"head_dim", optional_json(c.head_dim)},
          {"intermediate_size", optional_json(c.intermediate_size)},
          {"rope_scaling", c.rope_scaling},
          {"epochs", c.epochs},
          {"max_steps", c.max_steps},
          {"grad_accum", c.grad_accum},
          {"num_anchors", c.num_anchors},
          {"recompute", c.recompute},
          {"lr", c.lr},
          {"warmup_ratio", c.warmup_ratio},
          {"weight_decay", c.weight_decay},
          {"beta1", c.beta1},
          {"beta2", c.beta2},
          {"eps", c.eps},
          {"max_grad_norm", c.max_grad_norm},
          {"gamma", c.gamma},
          {"loss", c.loss},
          {"save_every", c.save_every},
          {"keep_last", c.keep_last},
          {"log_every", c.log_every},
          {"stages_every", c.stages_every},
          {"nan_abort", c.nan_abort},
          {"steps_this_run", c.steps_this_run},
          {"eval_data", c.eval_data},
          {"eval_every", c.eval_every},
          {"eval_limit", c.eval_limit},
          {"eval_max_new_tokens", c.eval_max_new_tokens},
          {"eval_batch_size", c.eval_batch_size},
          {"resume", c.resume}};
}

TrainConfig train_config_from_json(const nlohmann::json& j, const std::string& where, TrainConfig c) {
  if (!j.is_object()) throw std::runtime_error(where + ": a training config must be a JSON object");
  nlohmann::json all = to_json(c);
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (!all.contains(k)) throw std::runtime_error(where + ": unknown key '" + k + "'");
    const nlohmann::json &want = all[k], &v = it.value();
    auto all_ints = [](const nlohmann::json& a) {
      for (const auto& x : a)
        if (!x.is_number_integer()) return false;
      return true;
    };
    auto all_device_ids = [](const nlohmann::json& a) {
      for (const auto& x : a)
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX) return false;
      return true;
    };
    auto all_strings = [](const nlohmann::json& a) {
      for (const auto& x : a)
        if (!x.is_string()) return false;
      return true;
    };
    const bool optional = k == "mask_token_id" || k == "num_attention_heads" || k == "num_key_value_heads" ||
                          k == "head_dim" || k == "intermediate_size";
    const bool ok = optional ? (v.is_null() || v.is_number_integer())
                    : k == "layer_types"  ? (v.is_array() && all_strings(v))
                    : k == "rope_scaling" ? (v.is_null() || v.is_object())
                    : k == "seed"        ? v.is_number_unsigned()
                    : k == "target_layer_ids" ? (v.is_array() && all_ints(v))
                    : k == "gpus" || k == "target_gpus" || k == "drafter_gpus" ? (v.is_array() && all_device_ids(v))
                    : k == "data" || k == "eval_data" ? (v.is_array() && all_strings(v))
                    : want.is_number_float()  ? v.is_number()
                    : want.is_number_integer() ? v.is_number_integer() && v.get<int64_t>() >= INT32_MIN
                                               : want.type() == v.type();
    if (!ok) throw std::runtime_error(where + ": key '" + k + "' has a value of the wrong type (" + v.dump() + ")");
  }
  all.update(j);
  try {
    c.target = all["target"], c.data = all["data"].get<std::vector<std::string>>(), c.out = all["out"];
    c.tokenizer = all["tokenizer"], c.chat_template = all["chat_template"], c.device = all["device"];
    c.gpus = all["gpus"].get<std::vector<int>>();
    c.target_batch_tokens = all["target_batch_tokens"], c.target_dtype = all["target_dtype"];
    c.target_gpus = all["target_gpus"].get<std::vector<int>>(), c.drafter_gpus = all["drafter_gpus"].get<std::vector<int>>();
    c.init_from = all["init_from"], c.max_length = all["max_length"];
    c.shuffle = all["shuffle"], c.seed = all["seed"], c.num_draft_layers = all["num_draft_layers"];
    c.drafter_type = all["drafter_type"], c.markov_rank = all["markov_rank"];
    c.num_taps = all["num_taps"], c.block_size = all["block_size"];
    c.target_layer_ids = all["target_layer_ids"].get<std::vector<int64_t>>();
    c.mask_token_id = optional_int(all["mask_token_id"]);
    c.layer_types = all["layer_types"].get<std::vector<std::string>>();
    // the layer count follows layer_types when only they are given
    if (j.contains("layer_types") && !c.layer_types.empty() && !j.contains("num_draft_layers"))
      c.num_draft_layers = int64_t(c.layer_types.size());
    c.sliding_window = all["sliding_window"];
    c.num_attention_heads = optional_int(all["num_attention_heads"]);
    c.num_key_value_heads = optional_int(all["num_key_value_heads"]);
    c.head_dim = optional_int(all["head_dim"]), c.intermediate_size = optional_int(all["intermediate_size"]);
    c.rope_scaling = all["rope_scaling"];
    c.epochs = all["epochs"], c.max_steps = all["max_steps"], c.grad_accum = all["grad_accum"];
    c.num_anchors = all["num_anchors"], c.lr = all["lr"], c.warmup_ratio = all["warmup_ratio"];
    c.recompute = all["recompute"];
    c.weight_decay = all["weight_decay"], c.beta1 = all["beta1"], c.beta2 = all["beta2"], c.eps = all["eps"];
    c.max_grad_norm = all["max_grad_norm"], c.gamma = all["gamma"], c.loss = all["loss"], c.save_every = all["save_every"];
    c.keep_last = all["keep_last"], c.log_every = all["log_every"], c.stages_every = all["stages_every"];
    c.nan_abort = all["nan_abort"], c.steps_this_run = all["steps_this_run"], c.resume = all["resume"];
    c.eval_data = all["eval_data"].get<std::vector<std::string>>(), c.eval_every = all["eval_every"];
    c.eval_limit = all["eval_limit"], c.eval_max_new_tokens = all["eval_max_new_tokens"];
    c.eval_batch_size = all["eval_batch_size"];
  } catch (const nlohmann::json::exception& e) {  // e.g. a list of non-strings in data
    throw std::runtime_error(where + ": " + e.what());
  }
  return c;
}

}  // namespace dflash
