// The mixture-of-experts FFN of Qwen3-Next and Qwen3.5 / 3.6-MoE targets (transformers
// models/qwen2_moe/modular_qwen2_moe.py: Qwen2MoeTopKRouter, Qwen2MoeSparseMoeBlock; MixtralExperts):
// weights in either file layout and the fp32 reference forward.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "models/target.h"
#include "ops/activation.h"
#include "ops/linear.h"

namespace dflash {

namespace {
/// Rows [first, first + n) of a [E, rows, cols] tensor as a [n, cols] tensor of expert e.
Tensor expert_slice(const Tensor& all, int64_t e, int64_t first, int64_t n) {
  const int64_t rows = all.dim(1), cols = all.dim(2);
  Tensor t({n, cols});
  std::copy_n(all.ptr() + (e * rows + first) * cols, n * cols, t.ptr());
  return t;
}
}  // namespace

MoeWeights load_moe_weights(const ModelSpec& s, const WeightSource& src, const std::string& p) {
  const int64_t D = s.hidden_size, E = s.num_experts, Im = s.moe_intermediate_size;
  const int64_t Is = s.shared_expert_intermediate_size;
  MoeWeights w;
  w.router = load_checked(src, p + "gate.weight", {E, D});
  if (src.has(p + "experts.gate_up_proj")) {
    const Tensor gu = load_checked(src, p + "experts.gate_up_proj", {E, 2 * Im, D});
    const Tensor dn = load_checked(src, p + "experts.down_proj", {E, D, Im});
    for (int64_t e = 0; e < E; ++e) {
      w.gate_up.push_back(expert_slice(gu, e, 0, 2 * Im));
      w.down.push_back(expert_slice(dn, e, 0, D));
    }
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = p + "experts." + std::to_string(e) + ".";
      const Tensor g = load_checked(src, ep + "gate_proj.weight", {Im, D});
      const Tensor u = load_checked(src, ep + "up_proj.weight", {Im, D});
      Tensor gu({2 * Im, D});
      std::copy(g.data.begin(), g.data.end(), gu.ptr());
      std::copy(u.data.begin(), u.data.end(), gu.ptr() + Im * D);
      w.gate_up.push_back(std::move(gu));
      w.down.push_back(load_checked(src, ep + "down_proj.weight", {D, Im}));
    }
  }
  if (Is > 0) {
    w.shared.gate_proj = load_checked(src, p + "shared_expert.gate_proj.weight", {Is, D});
    w.shared.up_proj = load_checked(src, p + "shared_expert.up_proj.weight", {Is, D});
    w.shared.down_proj = load_checked(src, p + "shared_expert.down_proj.weight", {D, Is});
    w.shared_gate = load_checked(src, p + "shared_expert_gate.weight", {1, D});
  }
  return w;
}

MoeRouting moe_route(const Tensor& logits, int64_t k, bool norm_topk_prob) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  if (k <= 0 || k > E)
    throw std::invalid_argument("moe_route: " + std::to_string(k) + " experts per token of " + std::to_string(E));
  // Softmax over the experts, the k largest probabilities (lower index first on ties), renormalized
  // to sum 1 when norm_topk_prob.
  MoeRouting r;
  r.ids.resize(size_t(T * k));
  r.weights.resize(size_t(T * k));
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::vector<double> p(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.row(t);
    for (int64_t e = 0; e < E; ++e)
      if (!std::isfinite(l[e]))
        throw std::runtime_error("mixture of experts: router logit of expert " + std::to_string(e) + " for token " +
                                 std::to_string(t) + " is not finite (the layer's input holds NaN / Inf)");
    const float m = *std::max_element(l, l + E);
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += p[size_t(e)] = std::exp(double(l[e]) - double(m));
    for (double& v : p) v /= z;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return p[size_t(a)] != p[size_t(b)] ? p[size_t(a)] > p[size_t(b)] : a < b;
    });
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += p[size_t(order[size_t(j)])];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[size_t(j)];
      r.ids[size_t(t * k + j)] = int32_t(e);
      r.weights[size_t(t * k + j)] = float(norm_topk_prob ? p[size_t(e)] / sum : p[size_t(e)]);
    }
  }
  return r;
}

Tensor moe_forward(const ModelSpec& s, const MoeWeights& w, const Tensor& x) {
  const int64_t T = x.dim(0), D = x.dim(1), E = s.num_experts, k = s.num_experts_per_tok;
  const int64_t Im = s.moe_intermediate_size;
  if (k <= 0 || k > E || int64_t(w.gate_up.size()) != E)
    throw std::invalid_argument("moe_forward: " + std::to_string(k) + " experts per token of " + std::to_string(E) +
                                " (" + std::to_string(w.gate_up.size()) + " loaded)");
  const MoeRouting route = moe_route(cpu::linear(x, w.router, "mlp.gate"), k, s.norm_topk_prob);
  // Tokens grouped by expert: (token, weight).
  std::vector<std::vector<std::pair<int64_t, float>>> routed(static_cast<size_t>(E));
  for (int64_t i = 0; i < T * k; ++i) routed[size_t(route.ids[size_t(i)])].emplace_back(i / k, route.weights[size_t(i)]);
  Tensor y({T, D});
  for (int64_t e = 0; e < E; ++e) {
    const auto& rt = routed[size_t(e)];
    if (rt.empty()) continue;
    const int64_t n = int64_t(rt.size());
    Tensor xe({n, D});
    for (int64_t r = 0; r < n; ++r) std::copy_n(x.row(rt[size_t(r)].first), D, xe.row(r));
    const Tensor gu = cpu::linear(xe, w.gate_up[size_t(e)], "mlp.experts.gate_up_proj");  // [n, 2*Im]
    Tensor act({n, Im});
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < Im; ++i) act.row(r)[i] = cpu::silu(gu.row(r)[i]) * gu.row(r)[Im + i];
    const Tensor out = cpu::linear(act, w.down[size_t(e)], "mlp.experts.down_proj");  // [n, D]
    for (int64_t r = 0; r < n; ++r) {
      float* yr = y.row(rt[size_t(r)].first);
      const float wt = rt[size_t(r)].second;
      for (int64_t c = 0; c < D; ++c) yr[c] += wt * out.row(r)[c];
    }
  }
  if (s.shared_expert_intermediate_size > 0) {
    Tensor g = cpu::linear(x, w.shared.gate_proj, "mlp.shared_expert.gate_proj");
    cpu::swiglu(g, cpu::linear(x, w.shared.up_proj, "mlp.shared_expert.up_proj"));
    const Tensor sh = cpu::linear(g, w.shared.down_proj, "mlp.shared_expert.down_proj");
    const Tensor sg = cpu::linear(x, w.shared_gate, "mlp.shared_expert_gate");  // [T, 1]
    for (int64_t t = 0; t < T; ++t) {
      const float gate = cpu::sigmoid(sg.data[size_t(t)]);
      for (int64_t c = 0; c < D; ++c) y.row(t)[c] += gate * sh.row(t)[c];
    }
  }
  return y;
}

}  // namespace dflash
