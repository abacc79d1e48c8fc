// Mapping of llama.cpp's `llama` GGUF architecture onto ModelSpec and Hugging Face tensor names.
// Metadata keys follow llama.cpp's gguf-py constants (Keys.LLM / Keys.Attention / Keys.Rope);
// tensor names follow its MODEL_TENSOR table for MODEL_ARCH.LLAMA.
#include <algorithm>
#include <cctype>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/gguf_llama.h"

namespace dflash {

namespace {

[[noreturn]] void fail(const GGUFFile& f, const std::string& msg) {
  throw std::runtime_error(fmt::format("GGUF file '{}': {}", f.path(), msg));
}

const nlohmann::json* find_key(const GGUFFile& f, const std::string& key) {
  auto it = f.metadata().find(key);
  return it == f.metadata().end() ? nullptr : &*it;
}

/// Non-negative integer metadata value; `dflt` < 0 means required.
int64_t get_uint(const GGUFFile& f, const std::string& key, int64_t dflt = -1) {
  const nlohmann::json* v = find_key(f, key);
  if (!v) {
    if (dflt < 0) fail(f, fmt::format("missing metadata key '{}'", key));
    return dflt;
  }
  if (v->is_array())
    fail(f, fmt::format("metadata key '{}' is an array (per-layer values are not supported)", key));
  if (!v->is_number_integer())
    fail(f, fmt::format("metadata key '{}' must be an integer, got {}", key, v->type_name()));
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > uint64_t(INT64_MAX)) fail(f, fmt::format("metadata key '{}' is too large: {}", key, u));
    return int64_t(u);
  }
  const int64_t i = v->get<int64_t>();
  if (i < 0) fail(f, fmt::format("metadata key '{}' must be non-negative, got {}", key, i));
  return i;
}

double get_number(const GGUFFile& f, const std::string& key, const double* dflt) {
  const nlohmann::json* v = find_key(f, key);
  if (!v) {
    if (!dflt) fail(f, fmt::format("missing metadata key '{}'", key));
    return *dflt;
  }
  if (!v->is_number())
    fail(f, fmt::format("metadata key '{}' must be a number, got {}", key, v->type_name()));
  return v->get<double>();
}

struct StemMap {
  const char* gguf;
  const char* hf;
};
// Per-layer tensors: blk.N.<gguf>.{weight,bias} -> model.layers.N.<hf>.{weight,bias}.
constexpr StemMap kLayerStems[] = {
    {"attn_norm", "input_layernorm"},       {"attn_q", "self_attn.q_proj"},
    {"attn_k", "self_attn.k_proj"},         {"attn_v", "self_attn.v_proj"},
    {"attn_output", "self_attn.o_proj"},    {"ffn_norm", "post_attention_layernorm"},
    {"ffn_gate", "mlp.gate_proj"},          {"ffn_up", "mlp.up_proj"},
    {"ffn_down", "mlp.down_proj"},
};
// Whole-model tensors: <gguf>.{weight,bias} -> <hf>.{weight,bias}.
constexpr StemMap kGlobalStems[] = {
    {"token_embd", "model.embed_tokens"},
    {"output_norm", "model.norm"},
    {"output", "lm_head"},
};

/// Splits "blk.12.attn_q.weight" into layer "12", stem "attn_q", suffix "weight". False when the
/// name does not have that form (digits only for the layer, suffix weight or bias).
bool split_layer_name(const std::string& n, std::string* layer, std::string* stem,
                      std::string* suffix) {
  if (n.rfind("blk.", 0) != 0) return false;
  const std::size_t a = 4, b = n.find('.', a);
  if (b == std::string::npos || b == a) return false;
  for (std::size_t i = a; i < b; ++i)
    if (!std::isdigit(static_cast<unsigned char>(n[i]))) return false;
  const std::size_t c = n.rfind('.');
  if (c <= b + 1) return false;
  *layer = n.substr(a, b - a);
  *stem = n.substr(b + 1, c - b - 1);
  *suffix = n.substr(c + 1);
  return *suffix == "weight" || *suffix == "bias";
}

/// GGUF stem of a name ("attn_q" for "blk.3.attn_q.weight"), or "" for non-layer names.
std::string layer_stem(const std::string& gguf_name) {
  std::string layer, stem, suffix;
  return split_layer_name(gguf_name, &layer, &stem, &suffix) ? stem : std::string();
}

}  // namespace

std::vector<std::string> gguf_supported_architectures() { return {"llama"}; }

std::string gguf_llama_hf_name(const std::string& g) {
  std::string layer, stem, suffix;
  if (split_layer_name(g, &layer, &stem, &suffix)) {
    for (const auto& m : kLayerStems)
      if (stem == m.gguf) return "model.layers." + layer + "." + m.hf + "." + suffix;
    return g;
  }
  const std::size_t dot = g.rfind('.');
  if (dot == std::string::npos) return g;
  const std::string base = g.substr(0, dot), sfx = g.substr(dot + 1);
  if (sfx != "weight" && sfx != "bias") return g;
  for (const auto& m : kGlobalStems)
    if (base == m.gguf) return std::string(m.hf) + "." + sfx;
  return g;
}

void gguf_unpermute_qk_rows(Tensor& w, int64_t n_head, const std::string& what) {
  if (w.ndim() < 1 || n_head <= 0)
    throw std::runtime_error(what + ": cannot unpermute a scalar or with n_head <= 0");
  const int64_t rows = w.shape[0];
  if (rows % (2 * n_head) != 0)
    throw std::runtime_error(fmt::format(
        "{}: {} rows is not a multiple of 2 * n_head = {} (cannot undo the RoPE permutation)", what,
        rows, 2 * n_head));
  const int64_t cols = rows ? w.numel() / rows : 0;
  const int64_t hd = rows / n_head, half = hd / 2;
  std::vector<float> out(w.data.size());
  for (int64_t h = 0; h < n_head; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t i = 0; i < half; ++i) {
        const float* src = w.data.data() + (h * hd + 2 * i + s) * cols;
        std::copy(src, src + cols, out.data() + (h * hd + s * half + i) * cols);
      }
  w.data = std::move(out);
}

ModelSpec gguf_model_spec(const GGUFFile& f) {
  const auto archs = gguf_supported_architectures();
  const nlohmann::json* arch_v = find_key(f, "general.architecture");
  if (!arch_v || !arch_v->is_string())
    fail(f, fmt::format("metadata key 'general.architecture' is {} (supported architectures: {})",
                        arch_v ? "not a string" : "missing", fmt::join(archs, ", ")));
  const std::string arch = arch_v->get<std::string>();
  if (std::find(archs.begin(), archs.end(), arch) == archs.end())
    fail(f, fmt::format("unsupported architecture '{}' (supported architectures: {})", arch,
                        fmt::join(archs, ", ")));
  const std::string p = arch + ".";

  ModelSpec s;
  s.arch = Arch::Llama;
  s.architecture = "LlamaForCausalLM";
  s.model_type = "llama";
  s.weight_prefix = "model.";
  s.hidden_act = "silu";
  s.hidden_size = get_uint(f, p + "embedding_length");
  s.intermediate_size = get_uint(f, p + "feed_forward_length");
  s.num_hidden_layers = get_uint(f, p + "block_count");
  s.num_attention_heads = get_uint(f, p + "attention.head_count");
  s.num_key_value_heads = get_uint(f, p + "attention.head_count_kv", s.num_attention_heads);
  s.max_position_embeddings = get_uint(f, p + "context_length");
  s.rms_norm_eps = get_number(f, p + "attention.layer_norm_rms_epsilon", nullptr);
  const double theta_default = 10000.0;
  s.rope.type = "default";
  s.rope.theta = get_number(f, p + "rope.freq_base", &theta_default);

  if (s.hidden_size <= 0 || s.intermediate_size <= 0 || s.num_hidden_layers <= 0 ||
      s.num_attention_heads <= 0 || s.num_key_value_heads <= 0)
    fail(f, fmt::format("{}: embedding_length, feed_forward_length, block_count, "
                        "attention.head_count and attention.head_count_kv must be positive",
                        arch));
  if (s.num_attention_heads % s.num_key_value_heads != 0)
    fail(f, fmt::format("{}: attention.head_count {} is not a multiple of attention.head_count_kv {}",
                        arch, s.num_attention_heads, s.num_key_value_heads));
  if (!find_key(f, p + "attention.key_length") && s.hidden_size % s.num_attention_heads != 0)
    fail(f, fmt::format("{}: embedding_length {} is not a multiple of attention.head_count {} and "
                        "attention.key_length is absent",
                        arch, s.hidden_size, s.num_attention_heads));
  s.head_dim = get_uint(f, p + "attention.key_length", s.hidden_size / s.num_attention_heads);
  if (s.head_dim <= 0 || s.head_dim % 2 != 0)
    fail(f, fmt::format("metadata key '{}attention.key_length': head_dim {} must be positive and even",
                        p, s.head_dim));
  if (const int64_t vl = get_uint(f, p + "attention.value_length", s.head_dim); vl != s.head_dim)
    fail(f, fmt::format("metadata key '{}attention.value_length' = {} differs from key_length {} "
                        "(not supported)",
                        p, vl, s.head_dim));
  if (const int64_t rd = get_uint(f, p + "rope.dimension_count", s.head_dim); rd != s.head_dim)
    fail(f, fmt::format("metadata key '{}rope.dimension_count' = {} differs from head_dim {} "
                        "(partial rotary is not supported for llama)",
                        p, rd, s.head_dim));
  if (get_uint(f, p + "expert_count", 0) > 0)
    fail(f, fmt::format("metadata key '{}expert_count' > 0: mixture-of-experts llama models are "
                        "not supported",
                        p));
  if (const nlohmann::json* st = find_key(f, p + "rope.scaling.type");
      st && !(st->is_string() && st->get<std::string>() == "none"))
    fail(f, fmt::format("metadata key '{}rope.scaling.type' = {}: RoPE scaling is not supported", p,
                        st->dump()));
  if (f.find("rope_freqs.weight"))
    fail(f, "tensor 'rope_freqs.weight' present: llama3-style RoPE frequency scaling from GGUF is "
            "not supported");

  if (find_key(f, p + "vocab_size")) {
    s.vocab_size = get_uint(f, p + "vocab_size");
  } else if (const nlohmann::json* toks = find_key(f, "tokenizer.ggml.tokens")) {
    if (!toks->is_array())
      fail(f, "metadata key 'tokenizer.ggml.tokens' must be an array");
    s.vocab_size = int64_t(toks->size());
  } else {
    fail(f, fmt::format("neither '{}vocab_size' nor 'tokenizer.ggml.tokens' is present", p));
  }
  if (s.vocab_size <= 0) fail(f, "vocabulary size is zero");

  if (const GGUFTensorInfo* emb = f.find("token_embd.weight")) {
    if (emb->ne.size() != 2 || emb->ne[0] != s.hidden_size || emb->ne[1] != s.vocab_size)
      fail(f, fmt::format("tensor 'token_embd.weight' has shape {} but the metadata implies "
                          "[{}, {}] (vocab, hidden)",
                          shape_str(emb->shape()), s.vocab_size, s.hidden_size));
  }

  s.tie_word_embeddings = f.find("output.weight") == nullptr;
  s.layer_types.assign(std::size_t(s.num_hidden_layers), LayerKind::Attention);
  s.bos_token_id = -1;
  if (find_key(f, "tokenizer.ggml.bos_token_id"))
    s.bos_token_id = get_uint(f, "tokenizer.ggml.bos_token_id");
  s.eos_token_ids.clear();
  if (find_key(f, "tokenizer.ggml.eos_token_id"))
    s.eos_token_ids.push_back(get_uint(f, "tokenizer.ggml.eos_token_id"));
  return s;
}

// ---------------------------------------------------------------------------------------------
// GGUFWeights

GGUFWeights::GGUFWeights(const std::string& path)
    : GGUFWeights(std::make_shared<const GGUFFile>(path)) {}

GGUFWeights::GGUFWeights(std::shared_ptr<const GGUFFile> file) : file_(std::move(file)) {
  if (!file_) throw std::invalid_argument("GGUFWeights: null file");
  spec_ = gguf_model_spec(*file_);
  for (const auto& t : file_->tensors()) {
    std::string hf = gguf_llama_hf_name(t.name);
    auto [it, inserted] = hf_to_gguf_.emplace(hf, t.name);
    if (!inserted)
      fail(*file_, fmt::format("tensors '{}' and '{}' both map to the name '{}'", it->second,
                               t.name, hf));
    names_.push_back(std::move(hf));
  }
  std::sort(names_.begin(), names_.end());
}

std::vector<std::string> GGUFWeights::names() const { return names_; }

bool GGUFWeights::has(const std::string& name) const { return hf_to_gguf_.count(name) != 0; }

const std::string& GGUFWeights::gguf_name(const std::string& hf_name) const {
  auto it = hf_to_gguf_.find(hf_name);
  if (it == hf_to_gguf_.end()) fail(*file_, fmt::format("no tensor '{}'", hf_name));
  return it->second;
}

TensorInfo GGUFWeights::info(const std::string& name) const {
  const GGUFTensorInfo& t = file_->tensor(gguf_name(name));
  TensorInfo ti;
  ti.name = name;
  ti.dtype = DType::F32;
  ti.storage = t.type_name();
  ti.shape = t.shape();
  ti.file = file_->path() + " (" + ti.storage + ")";
  return ti;
}

Tensor GGUFWeights::load_f32(const std::string& name) const {
  const std::string& g = gguf_name(name);
  Tensor t = file_->dequantize(g);
  const std::string stem = layer_stem(g);
  const std::string what = fmt::format("GGUF file '{}': tensor '{}' ({})", file_->path(), g, name);
  if (stem == "attn_q") gguf_unpermute_qk_rows(t, spec_.num_attention_heads, what);
  else if (stem == "attn_k") gguf_unpermute_qk_rows(t, spec_.num_key_value_heads, what);
  return t;
}

}  // namespace dflash
