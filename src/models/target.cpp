#include "models/target.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <stdexcept>

#include "gpu/backend.h"
#include "io/fp8_checkpoint.h"
#include "io/gguf.h"
#include "io/json_file.h"
#include "io/safetensors.h"
#include "models/gguf_llama.h"
#include "models/hf_config.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace dflash {

Tensor load_checked(const WeightSource& src, const std::string& name, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& stored) {
  if (!src.has(name)) throw std::runtime_error(src.origin() + ": missing tensor '" + name + "'");
  const TensorInfo info = src.info(name);
  const std::vector<int64_t>& want = stored.empty() ? shape : stored;
  if (info.shape != want)
    throw std::runtime_error(info.file + ": tensor '" + name + "' has shape " + shape_str(info.shape) +
                             ", expected " + shape_str(want));
  Tensor t = src.load_f32(name);
  for (size_t i = 0; i < t.data.size(); ++i)
    if (!std::isfinite(t.data[i]))
      throw std::runtime_error(info.file + ": tensor '" + name + "' holds a non-finite value (" +
                               std::to_string(t.data[i]) + ") at flat index " + std::to_string(i));
  t.shape = shape;
  return t;
}

OpenedModel open_model(const std::string& path) {
  namespace fs = std::filesystem;
  OpenedModel m;
  if (fs::is_directory(path)) {
    const fs::path cfg = fs::path(path) / "config.json";
    if (!fs::exists(cfg))
      throw std::runtime_error(path + ": no config.json in this directory (a model directory holds config.json and "
                               "model.safetensors or model.safetensors.index.json + shards; or give a .gguf file)");
    const nlohmann::json config = read_json_file(cfg.string());
    m.spec = model_spec_from_hf_config(config, cfg.string());
    const std::optional<Fp8Format> fp8 = read_fp8_format(config, cfg.string());
    m.weights = fp8_dequantizing(SafetensorsCheckpoint::open(path), fp8);
    m.format = "safetensors";
    if (fp8)
      m.format += fp8->block_n > 0 ? " (" + fp8->quant_method + ": F8_E4M3 weights, " + std::to_string(fp8->block_n) +
                                         " x " + std::to_string(fp8->block_k) + " block scales, dequantized at load)"
                                   : " (" + fp8->quant_method + ": F8_E4M3 weights, per-channel scales, dequantized at load)";
  } else if (fs::path(path).extension() == ".gguf") {
    auto g = std::make_shared<const GGUFFile>(path);
    m.spec = gguf_model_spec(*g);
    m.spec.validate(path);
    m.weights = std::make_unique<GGUFWeights>(g);
    m.format = "gguf";
  } else if (!fs::exists(path)) {
    throw std::runtime_error(path + ": no such file or directory");
  } else {
    throw std::runtime_error(path + ": not a model (expected a checkpoint directory with config.json, or a .gguf file)");
  }
  return m;
}

std::unique_ptr<TargetModel> TargetModel::load(const std::string& path) {
  OpenedModel m = open_model(path);
  return from_weights(m.spec, *m.weights);
}

std::unique_ptr<TargetModel> TargetModel::from_weights(const ModelSpec& s, const WeightSource& src) {
  std::unique_ptr<TargetModel> m(new TargetModel());
  m->spec_ = s;
  const int64_t D = s.hidden_size, V = s.vocab_size, I = s.intermediate_size;
  const std::string& p = s.weight_prefix;
  m->embed_tokens_ = load_checked(src, p + "embed_tokens.weight", {V, D});
  m->norm_ = load_checked(src, p + "norm.weight", {D});
  if (!s.tie_word_embeddings) m->lm_head_ = load_checked(src, "lm_head.weight", {V, D});
  m->layers_.resize(size_t(s.num_hidden_layers));
  for (int64_t i = 0; i < s.num_hidden_layers; ++i) {
    LayerWeights& l = m->layers_[size_t(i)];
    const std::string lp = p + "layers." + std::to_string(i) + ".";
    l.kind = s.layer_types[size_t(i)];
    l.input_layernorm = load_checked(src, lp + "input_layernorm.weight", {D});
    l.post_attention_layernorm = load_checked(src, lp + "post_attention_layernorm.weight", {D});
    if (l.kind == LayerKind::Attention) l.attn = load_attention_weights(s, src, lp + "self_attn.");
    else l.gdn = load_gated_deltanet_weights(s, src, lp + "linear_attn.");
    l.moe_layer = s.is_moe_layer(i);
    if (l.moe_layer) {
      l.moe = load_moe_weights(s, src, lp + "mlp.");
    } else {
      l.mlp.gate_proj = load_checked(src, lp + "mlp.gate_proj.weight", {I, D});
      l.mlp.up_proj = load_checked(src, lp + "mlp.up_proj.weight", {I, D});
      l.mlp.down_proj = load_checked(src, lp + "mlp.down_proj.weight", {D, I});
    }
  }
  m->inv_freq_ = cpu::rope_inv_freq(s.rope, s.rotary_dim());
  return m;
}

TargetCache::TargetCache(const ModelSpec& s, int n_seq) {
  if (n_seq < 0) throw std::invalid_argument("TargetCache: negative number of sequences");
  const int64_t C = 2 * s.linear_num_key_heads * s.linear_key_head_dim +
                    s.linear_num_value_heads * s.linear_value_head_dim;
  Seq proto;
  proto.layers.resize(size_t(s.num_hidden_layers));
  for (size_t i = 0; i < proto.layers.size(); ++i) {
    Layer& l = proto.layers[i];
    if (s.layer_types[i] == LayerKind::Attention) {
      l.k = l.v = Tensor({0, s.num_key_value_heads, s.head_dim});
    } else {
      l.window = Tensor({s.linear_conv_kernel_dim - 1, C});
      l.state = Tensor({s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim});
    }
  }
  seqs.assign(size_t(n_seq), proto);
  empty_ = std::move(proto);
}

void TargetCache::clear(int s) { seqs.at(size_t(s)) = empty_; }

void TargetCache::rollback(int s, int64_t length) {
  if (s < 0 || s >= num_seqs())
    throw std::invalid_argument("TargetCache::rollback: sequence " + std::to_string(s) + " of " +
                                std::to_string(num_seqs()));
  Seq& q = seqs[size_t(s)];
  if (length < 0 || length > q.length)
    throw std::invalid_argument("TargetCache::rollback: length " + std::to_string(length) + " outside [0, " +
                                std::to_string(q.length) + "] (sequence " + std::to_string(s) + ")");
  if (length == q.length) return;
  for (Layer& l : q.layers) {
    if (l.state.numel() == 0) {  // attention
      const int64_t row = l.k.numel() / std::max<int64_t>(l.k.dim(0), 1);
      l.k.data.resize(size_t(length * row));
      l.v.data.resize(size_t(length * row));
      l.k.shape[0] = l.v.shape[0] = length;
      continue;
    }
    if (q.rollback_from < 0 || length < q.rollback_from)
      throw std::invalid_argument("TargetCache::rollback: GatedDeltaNet states of sequence " + std::to_string(s) +
                                  " are kept only back to length " + std::to_string(q.rollback_from) +
                                  " (run the forward with keep_rollback); asked for " + std::to_string(length));
    const int64_t j = length - q.rollback_from, C = l.window.dim(1), K1 = l.window.dim(0);
    std::copy_n(l.window_hist.ptr() + j * C, K1 * C, l.window.ptr());
    std::copy_n(l.state_hist.ptr() + j * l.state.numel(), l.state.numel(), l.state.ptr());
  }
  q.length = length;
}

namespace {
void add_inplace(Tensor& a, const Tensor& b) {
  for (int64_t i = 0; i < a.numel(); ++i) a.data[size_t(i)] += b.data[size_t(i)];
}
}  // namespace

ForwardOutput TargetModel::forward(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu,
                                   const ForwardOptions& opt, TargetCache* cache) const {
  const int64_t T = int64_t(ids.size()), L = spec_.num_hidden_layers;
  cpu::check_cu_seqlens(cu, T, "forward");
  if (cache && (int64_t(cu.size()) != cache->num_seqs() + 1 || !opt.logits))
    throw std::invalid_argument("forward: with a cache of " + std::to_string(cache->num_seqs()) +
                                " sequences, cu_seqlens needs " + std::to_string(cache->num_seqs() + 1) +
                                " entries (got " + std::to_string(cu.size()) + ") and logits must be requested");
  int deepest = opt.logits ? int(L) : -1;
  for (int j : opt.hidden_states) {
    if (j < 0 || j > L)
      throw std::invalid_argument("forward: hidden_states index " + std::to_string(j) + " outside [0, " +
                                  std::to_string(L) + "]");
    deepest = std::max(deepest, j);
  }
  auto wanted = [&](int j) {
    return std::find(opt.hidden_states.begin(), opt.hidden_states.end(), j) != opt.hidden_states.end();
  };
  std::vector<int64_t> positions(static_cast<size_t>(T));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
      positions[size_t(t)] = t - cu[s] + (cache ? cache->length(int(s)) : 0);
      if (ids[size_t(t)] < 0 || ids[size_t(t)] >= spec_.vocab_size)
        throw std::out_of_range("token id " + std::to_string(ids[size_t(t)]) + " (sequence " + std::to_string(s) +
                                ", position " + std::to_string(t - cu[s]) + ") is outside the vocabulary [0, " +
                                std::to_string(spec_.vocab_size) + ")");
    }

  ForwardOutput out;
  Tensor x = cpu::embedding(embed_tokens_, ids);  // [T, D]
  if (wanted(0)) out.hidden_states[0] = x;
  const bool zc = spec_.zero_centered_norm();
  // The last hidden state (j = L) is reported after the final norm, so the loop runs to L - 1 at most.
  const int run_layers = int(std::min<int64_t>(deepest, L));
  for (int i = 0; i < run_layers; ++i) {
    const LayerWeights& l = layers_[size_t(i)];
    Tensor h = x;
    cpu::rms_norm(h, l.input_layernorm, spec_.rms_norm_eps, zc);
    Tensor mixed = l.kind == LayerKind::Attention
                       ? attention_forward(spec_, l.attn, h, positions, inv_freq_, cu, cache, i, opt.keep_rollback)
                       : gated_deltanet_forward(spec_, l.gdn, h, cu, cache, i, opt.keep_rollback);
    add_inplace(x, mixed);
    h = x;
    cpu::rms_norm(h, l.post_attention_layernorm, spec_.rms_norm_eps, zc);
    if (l.moe_layer) {
      add_inplace(x, moe_forward(spec_, l.moe, h));
    } else {
      Tensor gate = cpu::linear(h, l.mlp.gate_proj, "mlp.gate_proj");
      cpu::swiglu(gate, cpu::linear(h, l.mlp.up_proj, "mlp.up_proj"));
      add_inplace(x, cpu::linear(gate, l.mlp.down_proj, "mlp.down_proj"));
    }
    if (i + 1 < L && wanted(i + 1)) out.hidden_states[i + 1] = x;
  }
  if (deepest == int(L)) {
    cpu::rms_norm(x, norm_, spec_.rms_norm_eps, zc);
    if (wanted(int(L))) out.hidden_states[int(L)] = x;
    if (opt.logits) out.logits = cpu::linear(x, lm_head_.numel() ? lm_head_ : embed_tokens_, "lm_head");
  }
  if (cache)
    for (int s = 0; s < cache->num_seqs(); ++s) {
      TargetCache::Seq& q = cache->seqs[size_t(s)];
      const int64_t n = cu[size_t(s) + 1] - cu[size_t(s)];
      // A forward without keep_rollback seals the tokens it adds; a sequence it gives no tokens keeps
      // what an earlier verification saved (continuous batching prefills new prompts in between).
      if (opt.keep_rollback) q.rollback_from = q.length;
      else if (n > 0) q.rollback_from = -1;
      q.length += n;
    }
  return out;
}

std::vector<int> tap_hidden_states(const std::vector<int64_t>& ids) {
  std::vector<int> r;
  for (int64_t id : ids) r.push_back(int(id + 1));
  return r;
}

Tensor concat_taps(const ForwardOutput& f, const std::vector<int64_t>& ids) {
  const auto K = int64_t(ids.size());
  if (K == 0) return Tensor();
  const Tensor& h0 = f.hidden_states.at(int(ids[0] + 1));
  const int64_t T = h0.dim(0), d = h0.dim(1);
  Tensor taps({T, K * d});
  for (int64_t k = 0; k < K; ++k) {
    const Tensor& h = f.hidden_states.at(int(ids[size_t(k)] + 1));
    for (int64_t t = 0; t < T; ++t) std::copy_n(h.row(t), d, taps.row(t) + k * d);
  }
  return taps;
}

std::string gpu_unsupported_reason(const ModelSpec& s) {
  if (s.num_experts > 0 && (s.hidden_size % 8 || s.moe_intermediate_size % 8 || s.num_experts > 1024 ||
                            s.num_experts_per_tok > 32))
    return "mixture of experts with hidden " + std::to_string(s.hidden_size) + ", expert width " +
           std::to_string(s.moe_intermediate_size) + ", " + std::to_string(s.num_experts_per_tok) + " of " +
           std::to_string(s.num_experts) +
           " experts (the GPU kernels take widths that are multiples of 8, up to 1024 experts and 32 per token)";
  const bool attention = std::count(s.layer_types.begin(), s.layer_types.end(), LayerKind::Attention) > 0;
  const bool gdn = std::count(s.layer_types.begin(), s.layer_types.end(), LayerKind::GatedDeltaNet) > 0;
  if (attention && s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256)
    return "head_dim " + std::to_string(s.head_dim) + " (the GPU attention kernels take 64, 128 or 256)";
  if (attention && s.rotary_dim() % 2) return "odd rotary dimension";
  if (gdn && (s.linear_key_head_dim > 128 || s.linear_value_head_dim > 128 || s.linear_key_head_dim % 4 ||
              s.linear_value_head_dim % 4))
    return "GatedDeltaNet head dims " + std::to_string(s.linear_key_head_dim) + " / " +
           std::to_string(s.linear_value_head_dim) + " (the GPU kernels take multiples of 4 up to 128)";
  if (gdn && s.linear_conv_kernel_dim > 8)
    return "conv kernel size " + std::to_string(s.linear_conv_kernel_dim) + " (the GPU kernel takes up to 8)";
  return "";
}

std::vector<KernelChoice> layer_kernels(const ModelSpec& s, int64_t layer, TargetDtype dtype) {
  const LayerKind kind = s.layer_types.at(size_t(layer));
  const bool moe = s.is_moe_layer(layer);
  std::vector<KernelChoice> r;
  r.push_back({"cpu",
               std::string(kind == LayerKind::Attention ? "cpu::causal_attention (reference, fp32)"
                                                        : "cpu::gated_delta_rule_recurrent + causal_conv1d_silu (reference, fp32)") +
                   (moe ? "; experts: moe_forward (reference, fp32)" : ""),
               ""});
  if (cuda_backend_built()) r.push_back(gpu_layer_kernel(s, layer, dtype));
  return r;
}

}  // namespace dflash
