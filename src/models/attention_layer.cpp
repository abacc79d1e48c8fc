// Weights of the softmax attention mixer shared by Llama, Qwen3 and Qwen3.5 full-attention layers
// (transformers LlamaAttention, Qwen3Attention, Qwen3_5Attention): weights and the reference forward.
#include <algorithm>
#include <cmath>

#include "models/target.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace dflash {

AttentionWeights load_attention_weights(const ModelSpec& s, const WeightSource& src, const std::string& p) {
  const int64_t D = s.hidden_size, H = s.num_attention_heads, Hkv = s.num_key_value_heads, Dh = s.head_dim;
  AttentionWeights w;
  w.q_proj = load_checked(src, p + "q_proj.weight", {H * Dh * (s.attn_output_gate() ? 2 : 1), D});
  w.k_proj = load_checked(src, p + "k_proj.weight", {Hkv * Dh, D});
  w.v_proj = load_checked(src, p + "v_proj.weight", {Hkv * Dh, D});
  w.o_proj = load_checked(src, p + "o_proj.weight", {D, H * Dh});
  if (s.has_qk_norm()) {
    w.q_norm = load_checked(src, p + "q_norm.weight", {Dh});
    w.k_norm = load_checked(src, p + "k_norm.weight", {Dh});
  }
  return w;
}

Tensor attention_forward(const ModelSpec& s, const AttentionWeights& w, const Tensor& x,
                         const std::vector<int64_t>& positions, const std::vector<float>& inv_freq,
                         const std::vector<int64_t>& cu, TargetCache* cache, int layer, bool keep_rollback) {
  (void)keep_rollback;  // truncating keys needs nothing saved
  const int64_t T = x.dim(0), H = s.num_attention_heads, Hkv = s.num_key_value_heads, Dh = s.head_dim;
  Tensor qg = cpu::linear(x, w.q_proj, "self_attn.q_proj");
  Tensor q({T, H, Dh}), gate;
  if (s.attn_output_gate()) {
    // q_proj output viewed [T, H, 2*Dh]: per head the first Dh are the query, the next Dh the gate.
    gate = Tensor({T, H, Dh});
    for (int64_t r = 0; r < T * H; ++r) {
      std::copy_n(qg.ptr() + r * 2 * Dh, Dh, q.ptr() + r * Dh);
      std::copy_n(qg.ptr() + r * 2 * Dh + Dh, Dh, gate.ptr() + r * Dh);
    }
  } else {
    q.data = std::move(qg.data);
  }
  Tensor k = cpu::linear(x, w.k_proj, "self_attn.k_proj");
  Tensor v = cpu::linear(x, w.v_proj, "self_attn.v_proj");
  k.shape = {T, Hkv, Dh};
  v.shape = {T, Hkv, Dh};
  if (s.has_qk_norm()) {
    cpu::rms_norm(q, w.q_norm, s.rms_norm_eps, s.zero_centered_norm());
    cpu::rms_norm(k, w.k_norm, s.rms_norm_eps, s.zero_centered_norm());
  }
  cpu::apply_rope(q, positions, inv_freq, s.rotary_dim());
  cpu::apply_rope(k, positions, inv_freq, s.rotary_dim());
  const float scale = 1.0f / std::sqrt(float(Dh));
  Tensor o;
  if (!cache) {
    o = cpu::causal_attention(q, k, v, cu, scale);
  } else {
    // Keys of sequence s: its cached rows, then its new rows (which the cache keeps from now on).
    std::vector<int64_t> cu_k{0};
    for (size_t i = 0; i + 1 < cu.size(); ++i) {
      TargetCache::Layer& c = cache->seqs[i].layers[size_t(layer)];
      const int64_t row = Hkv * Dh, n = cu[i + 1] - cu[i];
      c.k.data.insert(c.k.data.end(), k.data.begin() + cu[i] * row, k.data.begin() + cu[i + 1] * row);
      c.v.data.insert(c.v.data.end(), v.data.begin() + cu[i] * row, v.data.begin() + cu[i + 1] * row);
      c.k.shape = c.v.shape = {c.k.dim(0) + n, Hkv, Dh};
      cu_k.push_back(cu_k.back() + c.k.dim(0));
    }
    Tensor K({cu_k.back(), Hkv, Dh}), V({cu_k.back(), Hkv, Dh});
    for (size_t i = 0; i + 1 < cu.size(); ++i) {
      const TargetCache::Layer& c = cache->seqs[i].layers[size_t(layer)];
      std::copy(c.k.data.begin(), c.k.data.end(), K.ptr() + cu_k[i] * Hkv * Dh);
      std::copy(c.v.data.begin(), c.v.data.end(), V.ptr() + cu_k[i] * Hkv * Dh);
    }
    o = cpu::causal_attention(q, K, V, cu, cu_k, scale);
  }
  if (s.attn_output_gate())
    for (int64_t i = 0; i < o.numel(); ++i) o.data[size_t(i)] *= cpu::sigmoid(gate.data[size_t(i)]);
  o.shape = {T, H * Dh};
  return cpu::linear(o, w.o_proj, "self_attn.o_proj");
}

}  // namespace dflash
