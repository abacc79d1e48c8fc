// DFlash drafter: checkpoint loader and the forward + hand-written backward of one training sequence.
#include "models/drafter.h"

#include "models/dspark.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <stdexcept>

#include "io/json_file.h"
#include "io/safetensors.h"
#include "ops/activation.h"
#include "ops/chunked_ce.h"
#include "ops/dflash_attention.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace dflash {

namespace {

template <typename W, typename L>
auto named_impl(W& w) {
  std::vector<std::pair<std::string, L*>> r;
  for (size_t i = 0; i < w.layers.size(); ++i) {
    auto& l = w.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    r.emplace_back(p + "self_attn.q_proj.weight", &l.q_proj);
    r.emplace_back(p + "self_attn.k_proj.weight", &l.k_proj);
    r.emplace_back(p + "self_attn.v_proj.weight", &l.v_proj);
    r.emplace_back(p + "self_attn.o_proj.weight", &l.o_proj);
    r.emplace_back(p + "self_attn.q_norm.weight", &l.q_norm);
    r.emplace_back(p + "self_attn.k_norm.weight", &l.k_norm);
    r.emplace_back(p + "mlp.gate_proj.weight", &l.gate_proj);
    r.emplace_back(p + "mlp.up_proj.weight", &l.up_proj);
    r.emplace_back(p + "mlp.down_proj.weight", &l.down_proj);
    r.emplace_back(p + "input_layernorm.weight", &l.input_layernorm);
    r.emplace_back(p + "post_attention_layernorm.weight", &l.post_attention_layernorm);
  }
  r.emplace_back("fc.weight", &w.fc);
  r.emplace_back("hidden_norm.weight", &w.hidden_norm);
  r.emplace_back("norm.weight", &w.norm);
  if (!w.markov_w1.shape.empty()) {
    r.emplace_back("markov_head.markov_w1.weight", &w.markov_w1);
    r.emplace_back("markov_head.markov_w2.weight", &w.markov_w2);
    r.emplace_back("confidence_head.proj.weight", &w.confidence_w);
    r.emplace_back("confidence_head.proj.bias", &w.confidence_b);
  }
  return r;
}

/// Empty weights with the layers and, for DSpark, the heads of `c` (shapes set by drafter_param_shapes).
template <typename T>
DrafterWeights<T> drafter_skeleton(const DrafterConfig& c) {
  DrafterWeights<T> w;
  w.layers.resize(size_t(c.num_hidden_layers));
  if (c.is_dspark()) w.markov_w1.shape = {c.vocab_size, c.markov_rank};  // (named() then lists the heads)
  return w;
}

template <typename T>
BasicTensor<T> reshaped(BasicTensor<T> t, std::vector<int64_t> shape) {
  if (BasicTensor<T>::numel_of(shape) != t.numel())
    throw std::invalid_argument("drafter: cannot reshape " + shape_str(t.shape) + " to " + shape_str(shape));
  t.shape = std::move(shape);
  return t;
}

template <typename T>
void add_into(BasicTensor<T>& a, const BasicTensor<T>& b) {
  for (size_t i = 0; i < a.data.size(); ++i) a.data[i] += b.data[i];
}

/// cos / sin tables [n, hd/2] of the drafter's RoPE (reference: exact float64 inv_freq
/// (cpu::rope_frequencies<double>), float64 angle, cos/sin times the attention factor (yarn), rounded to
/// the compute dtype).
template <typename T>
struct Rope {
  int64_t half = 0;
  std::vector<T> c, s;
  Rope(const std::vector<int64_t>& pos, int64_t hd, const RopeSpec& rope) : half(hd / 2) {
    const std::vector<double> inv = cpu::rope_frequencies<double>(rope, hd);
    const double scale = cpu::rope_attention_factor(rope);
    c.resize(pos.size() * size_t(half));
    s.resize(c.size());
    for (size_t t = 0; t < pos.size(); ++t)
      for (int64_t i = 0; i < half; ++i) {
        const double ang = double(pos[t]) * inv[size_t(i)];
        c[t * size_t(half) + size_t(i)] = T(scale * std::cos(ang));
        s[t * size_t(half) + size_t(i)] = T(scale * std::sin(ang));
      }
  }
  // x [n, H, hd] in place; sign -1 = transpose (backward)
  void apply(BasicTensor<T>& x, T sign) const {
    const int64_t n = x.dim(0), H = x.dim(1), D = x.dim(2);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < H; ++h) {
        T* p = x.ptr() + (t * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const T cc = c[size_t(t * half + i)], ss = sign * s[size_t(t * half + i)];
          const T a = p[i], b = p[i + half];
          p[i] = a * cc - b * ss;
          p[i + half] = b * cc + a * ss;
        }
      }
  }
};

template <typename T>
struct LayerSaved {
  BasicTensor<T> x_in, inv_in, hn, kv_in;
  BasicTensor<T> q_pre, q_inv, q_rot, k_pre, k_inv, k_rot, v, o, lse;
  BasicTensor<T> x_mid, inv_post, hp, g, u, act;
};

void check_shape(const std::string& what, const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
  if (got != want)
    throw std::invalid_argument("drafter_step: " + what + " has shape " + shape_str(got) + ", expected " +
                                shape_str(want));
}

}  // namespace

template <typename T>
std::vector<std::pair<std::string, BasicTensor<T>*>> DrafterWeights<T>::named() {
  return named_impl<DrafterWeights<T>, BasicTensor<T>>(*this);
}
template <typename T>
std::vector<std::pair<std::string, const BasicTensor<T>*>> DrafterWeights<T>::named() const {
  return named_impl<const DrafterWeights<T>, const BasicTensor<T>>(*this);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> drafter_param_shapes(const DrafterConfig& c) {
  const int64_t d = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const int64_t I = c.intermediate_size, K = int64_t(c.target_layer_ids.size());
  std::vector<std::pair<std::string, std::vector<int64_t>>> r;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    r.push_back({p + "self_attn.q_proj.weight", {nh * hd, d}});
    r.push_back({p + "self_attn.k_proj.weight", {nkv * hd, d}});
    r.push_back({p + "self_attn.v_proj.weight", {nkv * hd, d}});
    r.push_back({p + "self_attn.o_proj.weight", {d, nh * hd}});
    r.push_back({p + "self_attn.q_norm.weight", {hd}});
    r.push_back({p + "self_attn.k_norm.weight", {hd}});
    r.push_back({p + "mlp.gate_proj.weight", {I, d}});
    r.push_back({p + "mlp.up_proj.weight", {I, d}});
    r.push_back({p + "mlp.down_proj.weight", {d, I}});
    r.push_back({p + "input_layernorm.weight", {d}});
    r.push_back({p + "post_attention_layernorm.weight", {d}});
  }
  r.push_back({"fc.weight", {d, K * d}});
  r.push_back({"hidden_norm.weight", {d}});
  r.push_back({"norm.weight", {d}});
  if (c.is_dspark()) {
    const int64_t V = c.vocab_size, rk = c.markov_rank;
    r.push_back({"markov_head.markov_w1.weight", {V, rk}});
    r.push_back({"markov_head.markov_w2.weight", {V, rk}});
    r.push_back({"confidence_head.proj.weight", {1, d + rk}});
    r.push_back({"confidence_head.proj.bias", {1}});
  }
  return r;
}

template <typename T>
DrafterWeights<T> drafter_zeros(const DrafterConfig& c) {
  DrafterWeights<T> w = drafter_skeleton<T>(c);
  const auto shapes = drafter_param_shapes(c);
  auto named = w.named();
  for (size_t i = 0; i < named.size(); ++i) *named[i].second = BasicTensor<T>(shapes[i].second);
  return w;
}

template <typename T>
DrafterWeights<T> load_drafter_weights(const std::string& dir, DrafterConfig* cfg_out) {
  namespace fs = std::filesystem;
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  const DrafterConfig cfg = drafter_config_from_json(read_json_file(cfg_path), cfg_path);
  const bool sharded = fs::exists(fs::path(dir) / "model.safetensors.index.json");
  const std::string st_path = (fs::path(dir) / (sharded ? "model.safetensors.index.json" : "model.safetensors")).string();
  if (!fs::exists(st_path)) throw std::runtime_error(st_path + ": no such file");
  const auto ckpt = SafetensorsCheckpoint::open(st_path);
  const auto shapes = drafter_param_shapes(cfg);
  std::set<std::string> expected;
  for (const auto& [n, s] : shapes) expected.insert(n);
  std::map<std::string, std::string> stored;  // stripped name -> stored name
  for (const std::string& n : ckpt->names()) {
    const std::string key = n.rfind("model.", 0) == 0 ? n.substr(6) : n;
    if (!expected.count(key)) throw std::runtime_error(st_path + ": unexpected tensor '" + n + "'");
    if (!stored.emplace(key, n).second) throw std::runtime_error(st_path + ": tensor '" + key + "' stored twice");
  }
  DrafterWeights<T> w = drafter_skeleton<T>(cfg);
  auto named = w.named();
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& [name, shape] = shapes[i];
    auto it = stored.find(name);
    if (it == stored.end()) throw std::runtime_error(st_path + ": missing tensor '" + name + "'");
    const TensorInfo info = ckpt->info(it->second);
    if (info.shape != shape)
      throw std::runtime_error(st_path + ": tensor '" + it->second + "' has shape " + shape_str(info.shape) +
                               ", expected " + shape_str(shape));
    *named[i].second = tensor_cast<T>(ckpt->load_f32(it->second));
  }
  if (cfg_out) *cfg_out = cfg;
  return w;
}

BlockLayout block_layout(const std::vector<int64_t>& ids, const std::vector<int64_t>& loss_mask,
                         const std::vector<int64_t>& anchors, int64_t N, int64_t B, int64_t mask_token_id, double gamma) {
  const int64_t S = int64_t(ids.size()), Q = N * B, na = int64_t(anchors.size());
  BlockLayout l;
  l.block_ids.assign(size_t(Q), 0);
  l.pos_q.assign(size_t(Q), 0);
  l.labels.assign(size_t(Q), 0);
  l.weights.assign(size_t(Q), 0.0);
  for (int64_t b = 0; b < N; ++b) {
    const bool valid = b < na;
    const int64_t a = valid ? anchors[size_t(b)] : 0;
    for (int64_t k = 0; k < B; ++k) {
      const size_t r = size_t(b * B + k);
      l.pos_q[r] = a + k;
      l.block_ids[r] = int32_t((valid && k == 0) ? ids[size_t(a)] : mask_token_id);
      if (valid && k >= 1 && a + k < S) {
        l.labels[r] = int32_t(ids[size_t(a + k)]);
        l.weights[r] = std::exp(-double(k - 1) / gamma) * double(loss_mask[size_t(a + k)]);
        l.weight_sum += l.weights[r];
      }
    }
  }
  l.pos_kv.resize(size_t(S + Q));
  for (int64_t j = 0; j < S; ++j) l.pos_kv[size_t(j)] = j;
  std::copy(l.pos_q.begin(), l.pos_q.end(), l.pos_kv.begin() + S);
  return l;
}

namespace {
/// k_norm + RoPE keys [n, Hkv, hd] and values of the rows `in` [n, d] at `pos` (layer lw).
void keys_values(const DrafterConfig& cfg, const DrafterLayerWeights<float>& lw, const Tensor& in,
                 const std::vector<int64_t>& pos, Tensor* k, Tensor* v) {
  const int64_t n = in.dim(0), hd = cfg.head_dim, Hkv = cfg.num_key_value_heads;
  *k = cpu::rms_norm_forward(reshaped(cpu::linear(in, lw.k_proj, "drafter k_proj"), {n, Hkv, hd}), lw.k_norm,
                             cfg.rms_norm_eps, nullptr);
  Rope<float>(pos, hd, cfg.rope).apply(*k, 1.f);
  *v = reshaped(cpu::linear(in, lw.v_proj, "drafter v_proj"), {n, Hkv, hd});
}
void append_rows(Tensor& to, const Tensor& rows) {
  to.data.insert(to.data.end(), rows.data.begin(), rows.data.end());
  to.shape[0] += rows.dim(0);
}
}  // namespace

std::vector<double> dpace_weights(const std::vector<double>& ce, const std::vector<bool>& valid, int64_t B) {
  if (B < 1 || ce.size() != valid.size() || ce.size() % size_t(B) != 0)
    throw std::invalid_argument("dpace_weights: " + std::to_string(ce.size()) + " CE values and " +
                                std::to_string(valid.size()) + " flags for blocks of " + std::to_string(B));
  std::vector<double> w(ce.size(), 0.0), P(static_cast<size_t>(B));
  for (size_t b0 = 0; b0 < ce.size(); b0 += size_t(B)) {
    double p = 1;
    for (int64_t k = 0; k < B; ++k) {  // P_k: the chance slots 1..k are all accepted
      const size_t r = b0 + size_t(k);
      if (valid[r]) p *= 0.5 * std::exp(-ce[r]) + 0.5;
      P[size_t(k)] = p;
    }
    double tail = 0;
    for (int64_t k = B - 1; k >= 0; --k) {  // w_k = sum_{m >= k} P_m
      tail += P[size_t(k)];
      if (valid[b0 + size_t(k)]) w[b0 + size_t(k)] = tail;
    }
  }
  return w;
}

template <typename T>
DrafterStepResult<T> drafter_step(const DrafterConfig& cfg, const DrafterWeights<T>& w, const DrafterSequence<T>& seq,
                                  const DrafterStepOptions& opt) {
  using namespace dflash::cpu;
  if (!seq.taps || !seq.embed || !seq.lm_head) throw std::invalid_argument("drafter_step: null input tensor");
  const int64_t d = cfg.hidden_size, hd = cfg.head_dim, H = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads;
  const int64_t K = int64_t(cfg.target_layer_ids.size()), B = cfg.block_size, L = cfg.num_hidden_layers;
  const int64_t S = int64_t(seq.ids.size()), N = seq.num_blocks, Q = N * B;
  const int64_t V = seq.embed->ndim() == 2 ? seq.embed->dim(0) : -1;
  check_shape("taps", seq.taps->shape, {S, K * d});
  check_shape("embed", seq.embed->shape, {V, d});
  check_shape("lm_head", seq.lm_head->shape, {V, d});
  if (int64_t(seq.loss_mask.size()) != S) throw std::invalid_argument("drafter_step: loss_mask size != ids size");
  if (int64_t(w.layers.size()) != L) throw std::invalid_argument("drafter_step: weights have the wrong layer count");
  if (N < int64_t(seq.anchors.size())) throw std::invalid_argument("drafter_step: more anchors than blocks");
  if (!(seq.gamma > 0)) throw std::invalid_argument("drafter_step: gamma must be > 0");
  if (cfg.is_dspark() && !seq.target_hidden)
    throw std::invalid_argument("drafter_step: a DSpark drafter needs the target's final hidden states");
  if (cfg.is_dspark() && seq.dpace) throw std::invalid_argument("drafter_step: D-PACE weights a DFlash drafter's loss, not DSpark's");
  if (cfg.is_dspark()) check_shape("target_hidden", seq.target_hidden->shape, {S, d});
  for (size_t b = 0; b < seq.anchors.size(); ++b) {
    const int64_t a = seq.anchors[b];
    if (a < 0 || a >= S || (b > 0 && a < seq.anchors[b - 1]))
      throw std::invalid_argument("drafter_step: anchors must be sorted and inside [0, " + std::to_string(S) + ")");
  }
  for (int64_t t : seq.ids)
    if (t < 0 || t >= V) throw std::invalid_argument("drafter_step: token id " + std::to_string(t) + " outside vocab");
  if (cfg.mask_token_id < 0 || cfg.mask_token_id >= V) throw std::invalid_argument("drafter_step: bad mask_token_id");

  // Block inputs, positions, labels and weights.
  const BlockLayout lay = block_layout(seq.ids, seq.loss_mask, seq.anchors, N, B, cfg.mask_token_id, seq.gamma);
  const std::vector<int64_t>&pos_q = lay.pos_q, &pos_kv = lay.pos_kv;
  const std::vector<int32_t>& labels = lay.labels;
  std::vector<T> wts(lay.weights.begin(), lay.weights.end());
  BasicTensor<T> x({Q, d});
  for (int64_t r = 0; r < Q; ++r) std::copy(seq.embed->row(lay.block_ids[size_t(r)]), seq.embed->row(lay.block_ids[size_t(r)]) + d, x.row(r));
  const Rope<T> rope_q(pos_q, hd, cfg.rope), rope_kv(pos_kv, hd, cfg.rope);
  const double scale = 1.0 / std::sqrt(double(hd));
  std::vector<std::vector<KvRanges>> ranges(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    ranges[size_t(i)] = dflash_kv_ranges(seq.anchors, N, B, S, cfg.layer_window(i), cfg.layer_causal(i));
  }

  // ---- forward ----
  const BasicTensor<T> fc_out = linear(*seq.taps, w.fc, "drafter fc");
  BasicTensor<T> inv_ctx;
  const BasicTensor<T> ctx = rms_norm_forward(fc_out, w.hidden_norm, cfg.rms_norm_eps, &inv_ctx);
  std::vector<LayerSaved<T>> sv(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    const auto& lw = w.layers[size_t(i)];
    auto& s = sv[size_t(i)];
    s.x_in = x;
    s.hn = rms_norm_forward(s.x_in, lw.input_layernorm, cfg.rms_norm_eps, &s.inv_in);
    s.kv_in = BasicTensor<T>({S + Q, d});
    std::copy(ctx.data.begin(), ctx.data.end(), s.kv_in.data.begin());
    std::copy(s.hn.data.begin(), s.hn.data.end(), s.kv_in.data.begin() + S * d);
    s.q_pre = reshaped(linear(s.hn, lw.q_proj, "drafter q_proj"), {Q, H, hd});
    s.q_rot = rms_norm_forward(s.q_pre, lw.q_norm, cfg.rms_norm_eps, &s.q_inv);
    rope_q.apply(s.q_rot, T(1));
    s.k_pre = reshaped(linear(s.kv_in, lw.k_proj, "drafter k_proj"), {S + Q, Hkv, hd});
    s.k_rot = rms_norm_forward(s.k_pre, lw.k_norm, cfg.rms_norm_eps, &s.k_inv);
    rope_kv.apply(s.k_rot, T(1));
    s.v = reshaped(linear(s.kv_in, lw.v_proj, "drafter v_proj"), {S + Q, Hkv, hd});
    s.o = masked_attention_forward(s.q_rot, s.k_rot, s.v, ranges[size_t(i)], scale, &s.lse);
    const BasicTensor<T> attn = linear(reshaped(s.o, {Q, H * hd}), lw.o_proj, "drafter o_proj");
    s.x_mid = x;
    add_into(s.x_mid, attn);
    s.hp = rms_norm_forward(s.x_mid, lw.post_attention_layernorm, cfg.rms_norm_eps, &s.inv_post);
    s.g = linear(s.hp, lw.gate_proj, "drafter gate_proj");
    s.u = linear(s.hp, lw.up_proj, "drafter up_proj");
    s.act = s.g;
    swiglu(s.act, s.u);
    const BasicTensor<T> mlp = linear(s.act, lw.down_proj, "drafter down_proj");
    x = s.x_mid;
    add_into(x, mlp);
  }
  BasicTensor<T> inv_final;
  const BasicTensor<T> hf = rms_norm_forward(x, w.norm, cfg.rms_norm_eps, &inv_final);

  DrafterStepResult<T> res;
  BasicTensor<T> dh;
  DrafterGrads<T>& gr = res.grads;
  if (opt.backward) gr = drafter_zeros<T>(cfg);
  if (cfg.is_dspark()) {  // DSpark's loss over the same final hidden states (src/models/dspark.h)
    const DSparkRows rows = dspark_rows(seq.ids, seq.loss_mask, seq.anchors, N, B, seq.gamma);
    DSparkLossResult<T> l = dspark_loss(w, hf, *seq.target_hidden, *seq.lm_head, rows, B, opt.backward ? &gr : nullptr,
                                        seq.confidence_targets);
    res.confidence_targets = std::move(l.confidence_targets);
    res.loss = l.loss, res.weight_sum = l.weight_sum;
    res.slot_correct = std::move(l.slot_correct), res.slot_count = std::move(l.slot_count);
    dh = std::move(l.dh);
    if (opt.keep_logits) res.logits = dspark_logits(w, hf, *seq.lm_head, rows.prev);
    if (!opt.backward) return res;
  } else {
    std::vector<T> loss_w = wts;
    if (seq.dpace) {  // the weights from each row's CE, detached
      const ChunkedCeResult<T> first =
          chunked_cross_entropy(hf, *seq.lm_head, labels, wts, opt.ce_row_chunk, opt.ce_vocab_chunk, nullptr);
      std::vector<double> row_ce(static_cast<size_t>(Q));
      std::vector<bool> valid(static_cast<size_t>(Q));
      for (int64_t r = 0; r < Q; ++r) valid[size_t(r)] = wts[size_t(r)] > T(0), row_ce[size_t(r)] = double(first.ce[size_t(r)]);
      const std::vector<double> dw = dpace_weights(row_ce, valid, B);
      for (int64_t r = 0; r < Q; ++r) loss_w[size_t(r)] = T(dw[size_t(r)]);
    }
    const ChunkedCeResult<T> ce = chunked_cross_entropy(hf, *seq.lm_head, labels, loss_w, opt.ce_row_chunk,
                                                        opt.ce_vocab_chunk, opt.backward ? &dh : nullptr);
    res.loss = ce.loss;
    res.weight_sum = ce.weight_sum;
    res.slot_correct.assign(size_t(B), 0);
    res.slot_count.assign(size_t(B), 0);
    for (int64_t r = 0; r < Q; ++r)
      if (wts[size_t(r)] > T(0)) {
        res.slot_count[size_t(r % B)] += 1;
        if (ce.argmax[size_t(r)] == labels[size_t(r)]) res.slot_correct[size_t(r % B)] += 1;
      }
    if (opt.keep_logits) res.logits = linear(hf, *seq.lm_head, "drafter lm_head");
    if (!opt.backward) return res;
  }

  // ---- backward ----
  BasicTensor<T> dx;
  rms_norm_backward(x, w.norm, inv_final, dh, &dx, &gr.norm);
  BasicTensor<T> dctx({S, d});
  for (int64_t i = L - 1; i >= 0; --i) {
    const auto& lw = w.layers[size_t(i)];
    auto& lg = gr.layers[size_t(i)];
    const auto& s = sv[size_t(i)];
    // MLP: x_out = x_mid + down(silu(gate(hp)) * up(hp))
    BasicTensor<T> dact, dg, du, dhp, dhp2, dxm;
    linear_backward(s.act, lw.down_proj, dx, &dact, &lg.down_proj, "drafter down_proj");
    swiglu_backward(s.g, s.u, dact, &dg, &du);
    linear_backward(s.hp, lw.gate_proj, dg, &dhp, &lg.gate_proj, "drafter gate_proj");
    linear_backward(s.hp, lw.up_proj, du, &dhp2, &lg.up_proj, "drafter up_proj");
    add_into(dhp, dhp2);
    rms_norm_backward(s.x_mid, lw.post_attention_layernorm, s.inv_post, dhp, &dxm, &lg.post_attention_layernorm);
    add_into(dx, dxm);  // dx is now d loss / d x_mid
    // attention: x_mid = x_in + o_proj(attn(q, k, v))
    BasicTensor<T> dof, dq, dk, dv;
    linear_backward(reshaped(s.o, {Q, H * hd}), lw.o_proj, dx, &dof, &lg.o_proj, "drafter o_proj");
    const BasicTensor<T> dout = reshaped(std::move(dof), {Q, H, hd});
    masked_attention_backward(s.q_rot, s.k_rot, s.v, s.o, s.lse, dout, ranges[size_t(i)], scale, &dq, &dk, &dv);
    rope_q.apply(dq, T(-1));
    rope_kv.apply(dk, T(-1));
    BasicTensor<T> dqp, dkp;
    rms_norm_backward(s.q_pre, lw.q_norm, s.q_inv, dq, &dqp, &lg.q_norm);
    rms_norm_backward(s.k_pre, lw.k_norm, s.k_inv, dk, &dkp, &lg.k_norm);
    BasicTensor<T> dhn, dkv, dkv2;
    linear_backward(s.hn, lw.q_proj, reshaped(std::move(dqp), {Q, H * hd}), &dhn, &lg.q_proj, "drafter q_proj");
    linear_backward(s.kv_in, lw.k_proj, reshaped(std::move(dkp), {S + Q, Hkv * hd}), &dkv, &lg.k_proj,
                    "drafter k_proj");
    linear_backward(s.kv_in, lw.v_proj, reshaped(std::move(dv), {S + Q, Hkv * hd}), &dkv2, &lg.v_proj,
                    "drafter v_proj");
    add_into(dkv, dkv2);
    for (int64_t j = 0; j < S * d; ++j) dctx.data[size_t(j)] += dkv.data[size_t(j)];
    for (int64_t j = 0; j < Q * d; ++j) dhn.data[size_t(j)] += dkv.data[size_t(S * d + j)];
    BasicTensor<T> dxi;
    rms_norm_backward(s.x_in, lw.input_layernorm, s.inv_in, dhn, &dxi, &lg.input_layernorm);
    add_into(dx, dxi);  // d loss / d x_in (the block embeddings are frozen: dx is dropped after layer 0)
  }
  BasicTensor<T> dfc;
  rms_norm_backward(fc_out, w.hidden_norm, inv_ctx, dctx, &dfc, &gr.hidden_norm);
  linear_backward(*seq.taps, w.fc, dfc, nullptr, &gr.fc, "drafter fc");
  return res;
}


void drafter_extend_context(const DrafterConfig& cfg, const DrafterWeights<float>& w, DrafterContextCache& c,
                            const Tensor& taps) {
  const int64_t d = cfg.hidden_size, m = taps.ndim() == 2 ? taps.dim(0) : -1;
  check_shape("context taps", taps.shape, {m, int64_t(cfg.target_layer_ids.size()) * d});
  if (c.k.empty()) {
    c.k.assign(size_t(cfg.num_hidden_layers), Tensor({0, cfg.num_key_value_heads, cfg.head_dim}));
    c.v = c.k;
  }
  const Tensor ctx = cpu::rms_norm_forward(cpu::linear(taps, w.fc, "drafter fc"), w.hidden_norm, cfg.rms_norm_eps, nullptr);
  std::vector<int64_t> pos(static_cast<size_t>(m));
  for (int64_t j = 0; j < m; ++j) pos[size_t(j)] = c.length + j;
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    Tensor k, v;
    keys_values(cfg, w.layers[size_t(i)], ctx, pos, &k, &v);
    append_rows(c.k[size_t(i)], k);
    append_rows(c.v[size_t(i)], v);
  }
  c.length += m;
}

Tensor drafter_draft_logits(const DrafterConfig& cfg, const DrafterWeights<float>& w, const DrafterContextCache& c,
                            int32_t last_token, const Tensor& embed, const Tensor& lm_head) {
  return cpu::linear(drafter_draft_hidden(cfg, w, c, last_token, embed), lm_head, "lm_head");
}

Tensor drafter_draft_hidden(const DrafterConfig& cfg, const DrafterWeights<float>& w, const DrafterContextCache& c,
                            int32_t last_token, const Tensor& embed) {
  using namespace dflash::cpu;
  const int64_t d = cfg.hidden_size, hd = cfg.head_dim, H = cfg.num_attention_heads, B = cfg.block_size;
  const int64_t p = c.length, V = embed.dim(0);
  if (last_token < 0 || last_token >= V) throw std::invalid_argument("drafter: token id outside the vocabulary");
  std::vector<int64_t> pos(static_cast<size_t>(B));
  Tensor x({B, d});
  for (int64_t k = 0; k < B; ++k) {
    pos[size_t(k)] = p + k;
    const int64_t id = k == 0 ? last_token : cfg.mask_token_id;
    std::copy(embed.row(id), embed.row(id) + d, x.row(k));
  }
  const Rope<float> rope(pos, hd, cfg.rope);
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const auto& lw = w.layers[size_t(i)];
    const Tensor hn = rms_norm_forward(x, lw.input_layernorm, cfg.rms_norm_eps, nullptr);
    Tensor q = rms_norm_forward(reshaped(linear(hn, lw.q_proj, "drafter q_proj"), {B, H, hd}), lw.q_norm,
                                cfg.rms_norm_eps, nullptr);
    rope.apply(q, 1.f);
    Tensor kb, vb;  // keys / values: the context's (cached), then the block's
    keys_values(cfg, lw, hn, pos, &kb, &vb);
    Tensor k = p ? c.k[size_t(i)] : Tensor({0, cfg.num_key_value_heads, hd}), v = p ? c.v[size_t(i)] : k;
    append_rows(k, kb);
    append_rows(v, vb);
    const auto ranges = dflash_kv_ranges({p}, 1, B, p, cfg.layer_window(i), cfg.layer_causal(i));
    const Tensor o = masked_attention_forward(q, k, v, ranges, 1.0 / std::sqrt(double(hd)), nullptr);
    add_into(x, linear(reshaped(o, {B, H * hd}), lw.o_proj, "drafter o_proj"));
    const Tensor hp = rms_norm_forward(x, lw.post_attention_layernorm, cfg.rms_norm_eps, nullptr);
    Tensor g = linear(hp, lw.gate_proj, "drafter gate_proj");
    swiglu(g, linear(hp, lw.up_proj, "drafter up_proj"));
    add_into(x, linear(g, lw.down_proj, "drafter down_proj"));
  }
  return rms_norm_forward(x, w.norm, cfg.rms_norm_eps, nullptr);
}

template struct DrafterWeights<float>;
template struct DrafterWeights<double>;
template DrafterWeights<float> drafter_zeros<float>(const DrafterConfig&);
template DrafterWeights<double> drafter_zeros<double>(const DrafterConfig&);
template DrafterWeights<float> load_drafter_weights<float>(const std::string&, DrafterConfig*);
template DrafterWeights<double> load_drafter_weights<double>(const std::string&, DrafterConfig*);
template DrafterStepResult<float> drafter_step<float>(const DrafterConfig&, const DrafterWeights<float>&,
                                                      const DrafterSequence<float>&, const DrafterStepOptions&);
template DrafterStepResult<double> drafter_step<double>(const DrafterConfig&, const DrafterWeights<double>&,
                                                        const DrafterSequence<double>&, const DrafterStepOptions&);

}  // namespace dflash
