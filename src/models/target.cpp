#include "models/target.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>

#include "io/gguf.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
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
    m.spec = load_hf_config(cfg.string());
    m.weights = SafetensorsCheckpoint::open(path);
    m.format = "safetensors";
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
    l.mlp.gate_proj = load_checked(src, lp + "mlp.gate_proj.weight", {I, D});
    l.mlp.up_proj = load_checked(src, lp + "mlp.up_proj.weight", {I, D});
    l.mlp.down_proj = load_checked(src, lp + "mlp.down_proj.weight", {D, I});
  }
  m->inv_freq_ = cpu::rope_inv_freq(s.rope, s.rotary_dim());
  return m;
}

namespace {
void add_inplace(Tensor& a, const Tensor& b) {
  for (int64_t i = 0; i < a.numel(); ++i) a.data[size_t(i)] += b.data[size_t(i)];
}
}  // namespace

ForwardOutput TargetModel::forward(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu,
                                   const ForwardOptions& opt) const {
  const int64_t T = int64_t(ids.size()), L = spec_.num_hidden_layers;
  cpu::check_cu_seqlens(cu, T, "forward");
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
      positions[size_t(t)] = t - cu[s];
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
    Tensor mixed = l.kind == LayerKind::Attention ? attention_forward(spec_, l.attn, h, positions, inv_freq_, cu)
                                                  : gated_deltanet_forward(spec_, l.gdn, h, cu);
    add_inplace(x, mixed);
    h = x;
    cpu::rms_norm(h, l.post_attention_layernorm, spec_.rms_norm_eps, zc);
    Tensor gate = cpu::linear(h, l.mlp.gate_proj, "mlp.gate_proj");
    cpu::swiglu(gate, cpu::linear(h, l.mlp.up_proj, "mlp.up_proj"));
    add_inplace(x, cpu::linear(gate, l.mlp.down_proj, "mlp.down_proj"));
    if (i + 1 < L && wanted(i + 1)) out.hidden_states[i + 1] = x;
  }
  if (deepest == int(L)) {
    cpu::rms_norm(x, norm_, spec_.rms_norm_eps, zc);
    if (wanted(int(L))) out.hidden_states[int(L)] = x;
    if (opt.logits) out.logits = cpu::linear(x, lm_head_.numel() ? lm_head_ : embed_tokens_, "lm_head");
  }
  return out;
}

std::string gpu_unsupported_reason(const ModelSpec& s) {
  for (LayerKind k : s.layer_types)
    if (k != LayerKind::Attention)
      return "the model has GatedDeltaNet layers, which have no GPU kernel yet (Qwen3.5 / 3.6 hybrids run on the "
             "CPU reference only)";
  if (s.attn_output_gate()) return "attention output gates have no GPU kernel yet";
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256)
    return "head_dim " + std::to_string(s.head_dim) + " (the GPU attention kernels take 64, 128 or 256)";
  if (s.rotary_dim() % 2) return "odd rotary dimension";
  return "";
}

std::vector<KernelChoice> layer_kernels(const ModelSpec& s, LayerKind kind) {
  std::vector<KernelChoice> r;
  r.push_back({"cpu", kind == LayerKind::Attention ? "cpu::causal_attention (reference, fp32)"
                                                   : "cpu::gated_delta_rule_recurrent + causal_conv1d_silu (reference, fp32)",
               ""});
#ifdef DFLASH_HAVE_CUDA
  const std::string why = gpu_unsupported_reason(s);
  if (why.empty())
    r.push_back({"cuda",
                 "cuda::masked_attention_forward<head_dim " + std::to_string(s.head_dim) +
                     "> (causal varlen, mma.sync bf16, fp32 softmax) + cuBLASLt bf16 GEMMs",
                 ""});
  else
    r.push_back({"cuda", "", why});  // no fallback is offered
#endif
  return r;
}

}  // namespace dflash
