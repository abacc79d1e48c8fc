// Qwen3.5 / Qwen3.6 hybrid (transformers models/qwen3_5/modeling_qwen3_5.py; docs/targets.md):
// GatedDeltaNet ("linear_attention") and gated full-attention layers, zero-centered RMSNorm,
// partial RoPE. Text-only Qwen3_5ForCausalLM and the multimodal Qwen3_5ForConditionalGeneration
// wrapper (text fields in text_config, weights under model.language_model.*, visual/mtp ignored).
#include <algorithm>
#include <cmath>

#include "models/hf_config.h"
#include "models/architectures.h"
#include "models/target.h"
#include "ops/activation.h"
#include "ops/gated_delta_rule.h"
#include "ops/linear.h"
#include "ops/norm.h"

namespace dflash {

ModelSpec qwen3_5_spec_from_config(const nlohmann::json& cfg, const std::string& where) {
  ModelSpec s;
  s.arch = Arch::Qwen3_5;
  const bool wrapper = cfg.contains("text_config");
  const nlohmann::json& t = wrapper ? cfg.at("text_config") : cfg;
  if (!t.is_object()) throw std::runtime_error(where + ": text_config must be an object");
  std::string arch, mt = cfg.value("model_type", std::string());
  if (auto it = cfg.find("architectures"); it != cfg.end() && it->is_array() && !it->empty() && (*it)[0].is_string())
    arch = (*it)[0].get<std::string>();
  const bool next = arch == "Qwen3NextForCausalLM" || mt == "qwen3_next";
  const bool moe = next || arch.find("Moe") != std::string::npos || mt.find("moe") != std::string::npos;
  if (next) {
    s.architecture = "Qwen3NextForCausalLM", s.model_type = "qwen3_next";
  } else if (moe) {
    s.architecture = wrapper ? "Qwen3_5MoeForConditionalGeneration" : "Qwen3_5MoeForCausalLM";
    s.model_type = wrapper ? "qwen3_5_moe" : "qwen3_5_moe_text";
  } else {
    s.architecture = wrapper ? "Qwen3_5ForConditionalGeneration" : "Qwen3_5ForCausalLM";
    s.model_type = wrapper ? "qwen3_5" : "qwen3_5_text";
  }
  s.weight_prefix = wrapper ? "model.language_model." : "model.";
  // Qwen3_5TextConfig.__post_init__: partial_rotary_factor defaults to 0.25 (Qwen3NextConfig too).
  // Qwen3.5-MoE has no dense MLP size: every layer is a mixture of experts.
  hf::read_dense_fields(t, s,
                        hf::DenseDefaults{.partial_rotary_factor = 0.25,
                                          .derive_head_shape = false,
                                          .intermediate_optional = moe && !next},
                        where + (wrapper ? " (text_config)" : ""));
  // The multimodal wrapper owns tying (Qwen3_5Config.tie_word_embeddings, default false); the
  // text_config value is not consulted, as in transformers.
  if (wrapper) s.tie_word_embeddings = cfg.value("tie_word_embeddings", false);
  if (moe) {
    // transformers Qwen3NextConfig / Qwen3_5MoeTextConfig: the Qwen3.5-MoE router always renormalizes
    // and every layer is sparse; Qwen3-Next reads norm_topk_prob, decoder_sparse_step, mlp_only_layers.
    s.num_experts = hf::req_int(t, "num_experts", where);
    s.num_experts_per_tok = hf::req_int(t, "num_experts_per_tok", where);
    s.moe_intermediate_size = hf::req_int(t, "moe_intermediate_size", where);
    s.shared_expert_intermediate_size = hf::req_int(t, "shared_expert_intermediate_size", where);
    if (next) {
      s.norm_topk_prob = t.value("norm_topk_prob", true);
      if (t.contains("decoder_sparse_step")) s.decoder_sparse_step = hf::req_int(t, "decoder_sparse_step", where);
      if (auto it = t.find("mlp_only_layers"); it != t.end() && !it->is_null()) {
        if (!it->is_array()) throw std::runtime_error(where + ": mlp_only_layers must be a list of layer indices");
        for (const auto& v : *it) {
          if (!v.is_number_integer()) throw std::runtime_error(where + ": mlp_only_layers holds a non-integer");
          s.mlp_only_layers.push_back(v.get<int64_t>());
        }
      }
      s.gdn_fused_projections = true;
    } else if (s.num_experts <= 0) {
      throw std::runtime_error(where + ": num_experts must be positive in a Qwen3.5-MoE config (got " +
                               std::to_string(s.num_experts) + ")");
    }
  }
  // The layer plan below is built from num_hidden_layers: bound it first (ModelSpec::validate's limit).
  if (s.num_hidden_layers <= 0 || s.num_hidden_layers > 4096)
    throw std::runtime_error(where + ": num_hidden_layers must be in [1, 4096] (got " +
                             std::to_string(s.num_hidden_layers) + ")");

  s.linear_num_key_heads = hf::req_int(t, "linear_num_key_heads", where);
  s.linear_num_value_heads = hf::req_int(t, "linear_num_value_heads", where);
  s.linear_key_head_dim = hf::req_int(t, "linear_key_head_dim", where);
  s.linear_value_head_dim = hf::req_int(t, "linear_value_head_dim", where);
  s.linear_conv_kernel_dim = t.contains("linear_conv_kernel_dim") ? hf::req_int(t, "linear_conv_kernel_dim", where) : 4;

  if (auto it = t.find("layer_types"); it != t.end() && it->is_array()) {
    for (const auto& lt : *it) {
      if (lt == "linear_attention") s.layer_types.push_back(LayerKind::GatedDeltaNet);
      else if (lt == "full_attention" || lt == "attention") s.layer_types.push_back(LayerKind::Attention);
      else throw std::runtime_error(where + ": unknown layer type " + lt.dump() +
                                    " (expected linear_attention or full_attention)");
    }
  } else {
    const int64_t interval = t.contains("full_attention_interval") ? hf::req_int(t, "full_attention_interval", where) : 4;
    if (interval <= 0) throw std::runtime_error(where + ": full_attention_interval must be positive");
    for (int64_t i = 0; i < s.num_hidden_layers; ++i)
      s.layer_types.push_back((i + 1) % interval == 0 ? LayerKind::Attention : LayerKind::GatedDeltaNet);
  }
  return s;
}

namespace {
/// Qwen3-Next's in_proj_qkvz [2*Hk*dk + 2*Hv*dv, D] holds, per key head g, the rows
/// [q_g (dk) | k_g (dk) | v of value heads g*r .. g*r+r-1 (r*dv) | z of the same (r*dv)], r = Hv / Hk,
/// and in_proj_ba [2*Hv, D] per key head [b (r) | a (r)] (transformers
/// Qwen3NextGatedDeltaNet.fix_query_key_value_ordering): a row permutation of Qwen3.5's
/// in_proj_qkv = [all q | all k | all v], in_proj_z, in_proj_b, in_proj_a.
void unfuse_qwen3_next_projections(const ModelSpec& s, const Tensor& qkvz, const Tensor& ba, GatedDeltaNetWeights& w) {
  const int64_t D = s.hidden_size, Hk = s.linear_num_key_heads, Hv = s.linear_num_value_heads;
  const int64_t dk = s.linear_key_head_dim, dv = s.linear_value_head_dim, r = Hv / Hk;
  w.in_proj_qkv = Tensor({2 * Hk * dk + Hv * dv, D});
  w.in_proj_z = Tensor({Hv * dv, D});
  w.in_proj_b = Tensor({Hv, D});
  w.in_proj_a = Tensor({Hv, D});
  auto copy_rows = [&](const Tensor& from, int64_t row, int64_t n, Tensor& to, int64_t to_row) {
    std::copy_n(from.ptr() + row * D, n * D, to.ptr() + to_row * D);
  };
  const int64_t group = 2 * dk + 2 * r * dv;  // rows of one key head in in_proj_qkvz
  for (int64_t g = 0; g < Hk; ++g) {
    const int64_t base = g * group;
    copy_rows(qkvz, base, dk, w.in_proj_qkv, g * dk);                                    // q
    copy_rows(qkvz, base + dk, dk, w.in_proj_qkv, Hk * dk + g * dk);                     // k
    copy_rows(qkvz, base + 2 * dk, r * dv, w.in_proj_qkv, 2 * Hk * dk + g * r * dv);     // v
    copy_rows(qkvz, base + 2 * dk + r * dv, r * dv, w.in_proj_z, g * r * dv);            // z
    copy_rows(ba, g * 2 * r, r, w.in_proj_b, g * r);                                     // b
    copy_rows(ba, g * 2 * r + r, r, w.in_proj_a, g * r);                                 // a
  }
}
}  // namespace

GatedDeltaNetWeights load_gated_deltanet_weights(const ModelSpec& s, const WeightSource& src, const std::string& p) {
  const int64_t D = s.hidden_size, Hk = s.linear_num_key_heads, Hv = s.linear_num_value_heads;
  const int64_t dk = s.linear_key_head_dim, dv = s.linear_value_head_dim, K = s.linear_conv_kernel_dim;
  const int64_t C = 2 * Hk * dk + Hv * dv;
  GatedDeltaNetWeights w;
  if (s.gdn_fused_projections) {
    unfuse_qwen3_next_projections(s, load_checked(src, p + "in_proj_qkvz.weight", {C + Hv * dv, D}),
                                  load_checked(src, p + "in_proj_ba.weight", {2 * Hv, D}), w);
  } else {
    w.in_proj_qkv = load_checked(src, p + "in_proj_qkv.weight", {C, D});
    w.in_proj_z = load_checked(src, p + "in_proj_z.weight", {Hv * dv, D});
    w.in_proj_b = load_checked(src, p + "in_proj_b.weight", {Hv, D});
    w.in_proj_a = load_checked(src, p + "in_proj_a.weight", {Hv, D});
  }
  w.conv1d = load_checked(src, p + "conv1d.weight", {C, K}, {C, 1, K});
  w.A_log = load_checked(src, p + "A_log", {Hv});
  w.dt_bias = load_checked(src, p + "dt_bias", {Hv});
  w.norm = load_checked(src, p + "norm.weight", {dv});
  w.out_proj = load_checked(src, p + "out_proj.weight", {D, Hv * dv});
  return w;
}

Tensor gated_deltanet_forward(const ModelSpec& s, const GatedDeltaNetWeights& w, const Tensor& x,
                              const std::vector<int64_t>& cu, TargetCache* cache, int layer, bool keep_rollback) {
  const int64_t T = x.dim(0), Hk = s.linear_num_key_heads, Hv = s.linear_num_value_heads;
  const int64_t dk = s.linear_key_head_dim, dv = s.linear_value_head_dim, C = 2 * Hk * dk + Hv * dv;
  const int64_t K = s.linear_conv_kernel_dim, nseq = int64_t(cu.size()) - 1;
  // Projections, then the causal depthwise conv + SiLU over the q|k|v channels.
  const Tensor pre = cpu::linear(x, w.in_proj_qkv, "linear_attn.in_proj_qkv");  // [T, C]
  Tensor window, init;  // [n, K-1, C], [n, Hv, dk, dv] from the cache
  if (cache) {
    window = Tensor({nseq, K - 1, C});
    init = Tensor({nseq, Hv, dk, dv});
    for (int64_t i = 0; i < nseq; ++i) {
      const TargetCache::Layer& c = cache->seqs[size_t(i)].layers[size_t(layer)];
      std::copy(c.window.data.begin(), c.window.data.end(), window.ptr() + i * (K - 1) * C);
      std::copy(c.state.data.begin(), c.state.data.end(), init.ptr() + i * Hv * dk * dv);
    }
  }
  const Tensor qkv = cpu::causal_conv1d_silu(pre, w.conv1d, cu, cache ? &window : nullptr);
  Tensor z = cpu::linear(x, w.in_proj_z, "linear_attn.in_proj_z");  // [T, Hv*dv]
  const Tensor b = cpu::linear(x, w.in_proj_b, "linear_attn.in_proj_b");  // [T, Hv]
  const Tensor a = cpu::linear(x, w.in_proj_a, "linear_attn.in_proj_a");  // [T, Hv]
  Tensor q({T, Hk, dk}), k({T, Hk, dk}), v({T, Hv, dv});
  for (int64_t t = 0; t < T; ++t) {
    const float* r = qkv.ptr() + t * C;
    std::copy_n(r, Hk * dk, q.ptr() + t * Hk * dk);
    std::copy_n(r + Hk * dk, Hk * dk, k.ptr() + t * Hk * dk);
    std::copy_n(r + 2 * Hk * dk, Hv * dv, v.ptr() + t * Hv * dv);
  }
  // beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), all fp32.
  Tensor beta({T, Hv}), g({T, Hv});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hv; ++h) {
      const size_t i = size_t(t * Hv + h);
      beta.data[i] = cpu::sigmoid(b.data[i]);
      g.data[i] = -std::exp(w.A_log.data[size_t(h)]) * cpu::softplus(a.data[i] + w.dt_bias.data[size_t(h)]);
    }
  Tensor final_state, token_states;
  Tensor o = cpu::gated_delta_rule_recurrent(q, k, v, g, beta, 1.0f / std::sqrt(float(dk)), /*use_qk_l2norm=*/true,
                                             cu, cache ? &init : nullptr, cache ? &final_state : nullptr,
                                             keep_rollback ? &token_states : nullptr);  // [T, Hv, dv]
  if (cache) {
    const int64_t St = Hv * dk * dv;
    for (int64_t i = 0; i < nseq; ++i) {
      TargetCache::Layer& c = cache->seqs[size_t(i)].layers[size_t(layer)];
      const int64_t b = cu[size_t(i)], n = cu[size_t(i) + 1] - b;
      // history = [old window ; new conv inputs]; the new window is its last K-1 rows.
      Tensor hist({K - 1 + n, C});
      std::copy(c.window.data.begin(), c.window.data.end(), hist.ptr());
      std::copy_n(pre.ptr() + b * C, n * C, hist.ptr() + (K - 1) * C);
      std::copy_n(hist.ptr() + n * C, (K - 1) * C, c.window.ptr());
      if (keep_rollback) {
        c.window_hist = std::move(hist);
        c.state_hist = Tensor({n + 1, Hv, dk, dv});
        std::copy(c.state.data.begin(), c.state.data.end(), c.state_hist.ptr());
        std::copy_n(token_states.ptr() + b * St, n * St, c.state_hist.ptr() + St);
      } else if (n > 0) {  // these tokens cannot be dropped; an idle sequence keeps its history
        c.window_hist = c.state_hist = Tensor();
      }
      std::copy_n(final_state.ptr() + i * St, St, c.state.ptr());
    }
  }
  cpu::gated_rms_norm(o, z, w.norm, s.rms_norm_eps);
  o.shape = {T, Hv * dv};
  return cpu::linear(o, w.out_proj, "linear_attn.out_proj");
}

}  // namespace dflash
