// DSpark's loss (forward + hand-written backward) and greedy drafting on the CPU: see dspark.h.
#include "models/dspark.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "ops/linear.h"

namespace dflash {

DSparkRows dspark_rows(const std::vector<int64_t>& ids, const std::vector<int64_t>& loss_mask,
                       const std::vector<int64_t>& anchors, int64_t N, int64_t B, double gamma) {
  const int64_t S = int64_t(ids.size()), Q = N * B;
  if (!(gamma > 0)) throw std::invalid_argument("dspark_rows: gamma must be > 0");
  if (int64_t(loss_mask.size()) != S || int64_t(anchors.size()) > N || B < 1)
    throw std::invalid_argument("dspark_rows: sizes of ids, loss_mask, anchors and blocks disagree");
  DSparkRows r;
  r.labels.assign(size_t(Q), 0);
  r.prev.assign(size_t(Q), 0);
  r.target_row.assign(size_t(Q), 0);
  r.weights.assign(size_t(Q), 0.0);
  for (size_t b = 0; b < anchors.size(); ++b) {
    const int64_t a = anchors[b];
    if (a < 0 || a >= S) throw std::invalid_argument("dspark_rows: anchor " + std::to_string(a) + " outside [0, S)");
    bool open = true;  // the eval mask is a prefix: a slot without a label closes the rest of the block
    for (int64_t k = 0; k < B; ++k) {
      const size_t row = b * size_t(B) + size_t(k);
      open = open && a + k + 1 < S && loss_mask[size_t(a + k + 1)] != 0;
      if (!open) break;
      r.labels[row] = int32_t(ids[size_t(a + k + 1)]);
      r.prev[row] = int32_t(ids[size_t(a + k)]);
      r.target_row[row] = a + k;
      r.weights[row] = std::exp(-double(k) / gamma);
      r.weight_sum += r.weights[row];
    }
  }
  return r;
}

namespace {

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("dspark_loss: " + what);
}

/// Rows `ids` of table [V, r].
template <typename T>
BasicTensor<T> gather_rows(const BasicTensor<T>& table, const std::vector<int32_t>& ids) {
  const int64_t V = table.dim(0), r = table.dim(1);
  BasicTensor<T> out({int64_t(ids.size()), r});
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= V) throw std::invalid_argument("dspark: token id " + std::to_string(ids[i]) + " outside the vocabulary");
    std::copy_n(table.row(ids[i]), r, out.row(int64_t(i)));
  }
  return out;
}

/// softmax of row z [V] into p; returns logsumexp.
template <typename T>
T softmax_row(const T* z, int64_t V, T* p) {
  const T m = *std::max_element(z, z + V);
  T sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += (p[v] = std::exp(z[v] - m));
  for (int64_t v = 0; v < V; ++v) p[v] /= sum;
  return m + std::log(sum);
}

}  // namespace

template <typename T>
BasicTensor<T> dspark_logits(const DrafterWeights<T>& w, const BasicTensor<T>& h, const BasicTensor<T>& lm_head,
                             const std::vector<int32_t>& prev) {
  BasicTensor<T> z = cpu::linear(h, lm_head, "dspark lm_head");
  const BasicTensor<T> bias = cpu::linear(gather_rows(w.markov_w1, prev), w.markov_w2, "dspark markov_w2");
  for (size_t i = 0; i < z.data.size(); ++i) z.data[i] += bias.data[i];
  return z;
}

template <typename T>
DSparkLossResult<T> dspark_loss(const DrafterWeights<T>& w, const BasicTensor<T>& h, const BasicTensor<T>& g,
                                const BasicTensor<T>& lm_head, const DSparkRows& rows, int64_t B, DrafterGrads<T>* grads,
                                const std::vector<T>* fixed_targets) {
  check(h.ndim() == 2 && lm_head.ndim() == 2 && g.ndim() == 2, "h, g and lm_head must be matrices");
  const int64_t Q = h.dim(0), d = h.dim(1), V = lm_head.dim(0);
  check(lm_head.dim(1) == d && g.dim(1) == d, "h " + shape_str(h.shape) + ", g " + shape_str(g.shape) + " and lm_head " +
                                                  shape_str(lm_head.shape) + " disagree");
  check(!w.markov_w1.shape.empty(), "the drafter has no DSpark heads");
  const int64_t r = w.markov_w1.dim(1);
  check(w.markov_w1.shape == std::vector<int64_t>{V, r} && w.markov_w2.shape == std::vector<int64_t>{V, r} &&
            w.confidence_w.shape == std::vector<int64_t>{1, d + r} && w.confidence_b.numel() == 1,
        "the DSpark heads' shapes do not match the vocabulary / hidden size");
  check(int64_t(rows.labels.size()) == Q && Q % B == 0, "rows and h disagree");
  for (int64_t t : rows.target_row) check(t >= 0 && t < g.dim(0), "target row outside g");
  check(!fixed_targets || int64_t(fixed_targets->size()) == Q, "fixed_targets must have one value per row");

  // Forward, all rows (those without a weight are skipped below): z, target logits t, e = W1[prev].
  const BasicTensor<T> e = gather_rows(w.markov_w1, rows.prev);
  const BasicTensor<T> z = dspark_logits(w, h, lm_head, rows.prev);
  BasicTensor<T> gsel({Q, d});
  for (int64_t i = 0; i < Q; ++i) std::copy_n(g.row(rows.target_row[size_t(i)]), d, gsel.row(i));
  const BasicTensor<T> tz = cpu::linear(gsel, lm_head, "dspark target lm_head");

  DSparkLossResult<T> res;
  res.slot_correct.assign(size_t(B), 0);
  res.slot_count.assign(size_t(B), 0);
  const T W = T(rows.weight_sum);
  res.weight_sum = W;
  res.confidence_targets.assign(size_t(Q), T(0));
  BasicTensor<T> dz({Q, V});
  std::vector<T> p(static_cast<size_t>(V)), q(static_cast<size_t>(V));
  std::vector<T> dc(static_cast<size_t>(Q), T(0));
  T ce_sum = 0, l1_sum = 0, bce_sum = 0;
  const T* cw = w.confidence_w.ptr();
  for (int64_t i = 0; i < Q; ++i) {
    const T wi = T(rows.weights[size_t(i)]);
    if (!(wi > 0)) continue;
    const int32_t label = rows.labels[size_t(i)];
    check(label >= 0 && label < V, "label outside the vocabulary");
    const T lse = softmax_row(z.row(i), V, p.data());
    softmax_row(tz.row(i), V, q.data());
    const T ce = lse - z.row(i)[label];
    T l1 = 0, sp = 0;
    for (int64_t v = 0; v < V; ++v) {
      const T diff = p[size_t(v)] - q[size_t(v)];
      l1 += std::abs(diff);
      sp += (diff > 0 ? T(1) : diff < 0 ? T(-1) : T(0)) * p[size_t(v)];
    }
    const T y = fixed_targets ? (*fixed_targets)[size_t(i)] : std::clamp(T(1) - l1 / 2, T(0), T(1));
    res.confidence_targets[size_t(i)] = y;
    T c = w.confidence_b.data[0];
    for (int64_t j = 0; j < d; ++j) c += cw[j] * h.row(i)[j];
    for (int64_t j = 0; j < r; ++j) c += cw[d + j] * e.row(i)[j];
    const T bce = std::max(c, T(0)) - c * y + std::log1p(std::exp(-std::abs(c)));
    ce_sum += wi * ce, l1_sum += wi * l1, bce_sum += wi * bce;
    const int64_t k = i % B;
    res.slot_count[size_t(k)] += 1;
    res.slot_correct[size_t(k)] += std::max_element(z.row(i), z.row(i) + V) - z.row(i) == label;
    // d loss / d z_v = coef (0.1 (p_v - [v = label]) + 0.9 p_v (s_v - sum_u s_u p_u)), s = sign(p - q)
    const T coef = wi / W;
    T* dzi = dz.row(i);
    for (int64_t v = 0; v < V; ++v) {
      const T diff = p[size_t(v)] - q[size_t(v)];
      const T s = diff > 0 ? T(1) : diff < 0 ? T(-1) : T(0);
      dzi[v] = coef * (T(0.1) * p[size_t(v)] + T(0.9) * p[size_t(v)] * (s - sp));
    }
    dzi[label] -= coef * T(0.1);
    dc[size_t(i)] = coef * (T(1) / (T(1) + std::exp(-c)) - y);  // BCE with logits against the detached y
  }
  if (W > 0) {
    res.ce = ce_sum / W, res.l1 = l1_sum / W, res.bce = bce_sum / W;
    res.loss = T(0.1) * res.ce + T(0.9) * res.l1 + res.bce;
  }
  if (!grads) return res;

  // Backward: z = lm_head h + W2 e, c = w_c . [h ; e] + b_c.
  BasicTensor<T> de;
  cpu::linear_backward(h, lm_head, dz, &res.dh, nullptr, "dspark lm_head");   // dh = dz lm_head
  cpu::linear_backward(e, w.markov_w2, dz, &de, &grads->markov_w2, "dspark markov_w2");  // de, dW2 += dz^T e
  for (int64_t i = 0; i < Q; ++i) {
    const T dci = dc[size_t(i)];
    if (dci == T(0)) continue;
    T* dhi = res.dh.row(i);
    T* dei = de.row(i);
    for (int64_t j = 0; j < d; ++j) dhi[j] += dci * cw[j], grads->confidence_w.data[size_t(j)] += dci * h.row(i)[j];
    for (int64_t j = 0; j < r; ++j)
      dei[j] += dci * cw[d + j], grads->confidence_w.data[size_t(d + j)] += dci * e.row(i)[j];
    grads->confidence_b.data[0] += dci;
  }
  for (int64_t i = 0; i < Q; ++i) {  // dW1[prev] += de (rows without a weight have de = 0)
    if (!(rows.weights[size_t(i)] > 0)) continue;
    T* dst = grads->markov_w1.row(rows.prev[size_t(i)]);
    for (int64_t j = 0; j < r; ++j) dst[j] += de.row(i)[j];
  }
  return res;
}

std::vector<int32_t> dspark_greedy_drafts(const DrafterWeights<float>& w, const Tensor& h, int32_t last,
                                          const Tensor& lm_head) {
  const int64_t B = h.dim(0), V = lm_head.dim(0);
  if (last < 0 || last >= V) throw std::invalid_argument("dspark: token id outside the vocabulary");
  const Tensor base = cpu::linear(h, lm_head, "dspark lm_head");  // [B, V]
  std::vector<int32_t> out;
  int32_t prev = last;
  for (int64_t k = 0; k < B; ++k) {
    const Tensor bias = cpu::linear(gather_rows(w.markov_w1, {prev}), w.markov_w2, "dspark markov_w2");
    const float* zb = base.row(k);
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (zb[v] + bias.data[size_t(v)] > zb[best] + bias.data[size_t(best)]) best = v;
    out.push_back(prev = int32_t(best));
  }
  return out;
}

template DSparkLossResult<float> dspark_loss<float>(const DrafterWeights<float>&, const Tensor&, const Tensor&,
                                                    const Tensor&, const DSparkRows&, int64_t, DrafterGrads<float>*,
                                                    const std::vector<float>*);
template DSparkLossResult<double> dspark_loss<double>(const DrafterWeights<double>&, const BasicTensor<double>&,
                                                      const BasicTensor<double>&, const BasicTensor<double>&,
                                                      const DSparkRows&, int64_t, DrafterGrads<double>*,
                                                      const std::vector<double>*);
template BasicTensor<float> dspark_logits<float>(const DrafterWeights<float>&, const Tensor&, const Tensor&,
                                                 const std::vector<int32_t>&);
template BasicTensor<double> dspark_logits<double>(const DrafterWeights<double>&, const BasicTensor<double>&,
                                                   const BasicTensor<double>&, const std::vector<int32_t>&);

}  // namespace dflash
