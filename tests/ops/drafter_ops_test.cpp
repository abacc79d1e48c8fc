// Drafter training ops: hand-written backwards against float64 central differences, float32 against
// float64, new forwards against naive references, and the DFlash mask builder element by element.
// Set DFLASH_PRINT_ERRORS=1 to print the measured errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

#include "ops/activation.h"
#include "ops/chunked_ce.h"
#include "ops/dflash_attention.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"
#include "tensor/tensor.h"
#include "test_util.h"

using namespace dflash;

namespace {


Tensor64 randn64(std::vector<int64_t> shape, uint32_t seed, double scale = 1.0, double mean = 0.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(mean, scale);
  Tensor64 t(std::move(shape));
  for (auto& x : t.data) x = nd(rng);
  return t;
}

Tensor f32(const Tensor64& t) { return tensor_cast<float>(t); }

void report(const std::string& what, double err) {
  if (std::getenv("DFLASH_PRINT_ERRORS")) std::printf("  [err] %-40s %.3e\n", what.c_str(), err);
}

/// ||a - b|| / ||b|| (0 when both are zero), a in any precision.
template <typename A>
double rel(const std::vector<A>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return 1e30;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

/// Central differences of the scalar `loss` w.r.t. every element of `param` (restored afterwards),
/// compared with `grad`: returns the relative L2 error.
double fd_error(Tensor64& param, const Tensor64& grad, const std::function<double()>& loss, double h = 1e-5) {
  std::vector<double> num(param.data.size());
  for (size_t i = 0; i < param.data.size(); ++i) {
    const double x0 = param.data[i];
    param.data[i] = x0 + h;
    const double lp = loss();
    param.data[i] = x0 - h;
    const double lm = loss();
    param.data[i] = x0;
    num[i] = (lp - lm) / (2 * h);
  }
  EXPECT_EQ(grad.shape, param.shape);
  return rel(grad.data, num);
}

double dot_sum(const Tensor64& a, const Tensor64& b) {
  double s = 0;
  for (size_t i = 0; i < a.data.size(); ++i) s += a.data[i] * b.data[i];
  return s;
}

bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}
bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

}  // namespace

TEST(DrafterOps, LinearBackward) {
  Tensor64 x = randn64({7, 12}, 1), w = randn64({5, 12}, 2, 0.3), R = randn64({7, 5}, 3);
  auto loss = [&] { return dot_sum(cpu::linear(x, w), R); };
  Tensor64 dx, dw = randn64({5, 12}, 4);  // dw accumulates onto what is there
  const Tensor64 dw0 = dw;
  cpu::linear_backward(x, w, R, &dx, &dw);
  for (size_t i = 0; i < dw.data.size(); ++i) dw.data[i] -= dw0.data[i];
  const double ex = fd_error(x, dx, loss), ew = fd_error(w, dw, loss);
  report("linear dx fd", ex);
  report("linear dw fd", ew);
  EXPECT_LE(ex, test::kTolFiniteDifference);
  EXPECT_LE(ew, test::kTolFiniteDifference);

  Tensor dx32, dw32;  // empty dw -> zeros
  cpu::linear_backward(f32(x), f32(w), f32(R), &dx32, &dw32);
  const double e32 = std::max({rel(cpu::linear(f32(x), f32(w)).data, cpu::linear(x, w).data),
                               rel(dx32.data, dx.data), rel(dw32.data, dw.data)});
  report("linear f32 vs f64", e32);
  EXPECT_LE(e32, test::kTolF32);
  Tensor bad;
  EXPECT_THROW(cpu::linear_backward(f32(x), f32(w), f32(x), &bad, &bad), std::invalid_argument);
}

TEST(DrafterOps, RmsNormBackward) {
  Tensor64 x = randn64({7, 3, 12}, 5), w = randn64({12}, 6, 0.2, 1.0), R = randn64({7, 3, 12}, 7);
  const double eps = 1e-6;
  auto loss = [&] { return dot_sum(cpu::rms_norm_forward(x, w, eps, nullptr), R); };
  Tensor64 inv, dx, dw;
  Tensor64 y = cpu::rms_norm_forward(x, w, eps, &inv);
  ASSERT_EQ(inv.shape, (std::vector<int64_t>{21}));
  cpu::rms_norm_backward(x, w, inv, R, &dx, &dw);
  const double ex = fd_error(x, dx, loss), ew = fd_error(w, dw, loss);
  report("rms_norm dx fd", ex);
  report("rms_norm dw fd", ew);
  EXPECT_LE(ex, test::kTolFiniteDifference);
  EXPECT_LE(ew, test::kTolFiniteDifference);

  // float32 training forward = the existing in-place inference norm; float32 vs float64.
  Tensor y_inf = f32(x);
  cpu::rms_norm(y_inf, f32(w), eps, false);
  Tensor inv32, dx32, dw32;
  Tensor y32 = cpu::rms_norm_forward(f32(x), f32(w), eps, &inv32);
  EXPECT_LE(rel(y32.data, tensor_cast<double>(y_inf).data), 1e-7);
  cpu::rms_norm_backward(f32(x), f32(w), inv32, f32(R), &dx32, &dw32);
  const double e32 = std::max({rel(y32.data, y.data), rel(dx32.data, dx.data), rel(dw32.data, dw.data)});
  report("rms_norm f32 vs f64", e32);
  EXPECT_LE(e32, test::kTolF32);
}

TEST(DrafterOps, RopeBackwardFullAndPartial) {
  RopeSpec spec;
  spec.theta = 10000.0;
  const std::vector<int64_t> pos{0, 3, 5, 17, 2, 9, 100};
  for (int64_t rot : {12, 8}) {
    const auto inv = cpu::rope_inv_freq(spec, rot);
    Tensor64 x = randn64({7, 4, 12}, 8), R = randn64({7, 4, 12}, 9);
    auto loss = [&] {
      Tensor64 y = x;
      cpu::apply_rope(y, pos, inv, rot);
      return dot_sum(y, R);
    };
    Tensor64 dx = R;
    cpu::apply_rope_backward(dx, pos, inv, rot);
    const double ex = fd_error(x, dx, loss);
    report("rope dx fd, rotary_dim " + std::to_string(rot), ex);
    EXPECT_LE(ex, test::kTolFiniteDifference);
    Tensor64 y = x;  // backward undoes the forward
    cpu::apply_rope(y, pos, inv, rot);
    cpu::apply_rope_backward(y, pos, inv, rot);
    EXPECT_LE(rel(y.data, x.data), 1e-14);
    Tensor y32 = f32(x), dx32 = f32(R);
    cpu::apply_rope(y32, pos, inv, rot);
    cpu::apply_rope_backward(dx32, pos, inv, rot);
    Tensor64 y64 = x;
    cpu::apply_rope(y64, pos, inv, rot);
    const double e32 = std::max(rel(y32.data, y64.data), rel(dx32.data, dx.data));
    report("rope f32 vs f64, rotary_dim " + std::to_string(rot), e32);
    EXPECT_LE(e32, test::kTolF32);
  }
}

TEST(DrafterOps, SwigluBackward) {
  Tensor64 g = randn64({7, 13}, 10, 2.0), u = randn64({7, 13}, 11), R = randn64({7, 13}, 12);
  auto loss = [&] {
    Tensor64 y = g;
    cpu::swiglu(y, u);
    return dot_sum(y, R);
  };
  Tensor64 dg, du;
  cpu::swiglu_backward(g, u, R, &dg, &du);
  const double eg = fd_error(g, dg, loss), eu = fd_error(u, du, loss);
  report("swiglu dgate fd", eg);
  report("swiglu dup fd", eu);
  EXPECT_LE(eg, test::kTolFiniteDifference);
  EXPECT_LE(eu, test::kTolFiniteDifference);
  Tensor y32 = f32(g), dg32, du32;
  cpu::swiglu(y32, f32(u));
  cpu::swiglu_backward(f32(g), f32(u), f32(R), &dg32, &du32);
  Tensor64 y = g;
  cpu::swiglu(y, u);
  const double e32 = std::max({rel(y32.data, y.data), rel(dg32.data, dg.data), rel(du32.data, du.data)});
  report("swiglu f32 vs f64", e32);
  EXPECT_LE(e32, test::kTolF32);
}

namespace {

/// The DFlash mask straight from the words of dflash.md: query slot k of block b (anchor a) sees
/// context j < a (sliding: also j >= a + k - (W - 1)) and, in its own block, all slots (full) or
/// slots <= k (sliding); other blocks and padding blocks (b >= anchors.size()) see nothing.
/// dflash.md's mask, one entry at a time: a window W > 0 limits the context and, looking back only,
/// makes the block causal; `causal` does that without a window.
bool naive_allowed(const std::vector<int64_t>& anchors, int64_t B, int64_t S, int64_t W, int64_t row, int64_t j,
                   bool causal = false) {
  const int64_t b = row / B, k = row % B;
  if (b >= int64_t(anchors.size())) return false;
  const int64_t a = anchors[size_t(b)];
  if (j < S) return j < a && (W <= 0 || j >= a + k - (W - 1));
  const int64_t jb = (j - S) / B, jk = (j - S) % B;
  return jb == b && ((W <= 0 && !causal) || jk <= k);
}

bool range_allowed(const cpu::KvRanges& r, int64_t j) {
  return (j >= r.ctx_begin && j < r.ctx_end) || (j >= r.blk_begin && j < r.blk_end);
}

/// Naive masked softmax attention in double over a boolean mask.
Tensor64 naive_attention(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                         const std::function<bool(int64_t, int64_t)>& allowed, double scale) {
  const int64_t Nq = q.dim(0), H = q.dim(1), Nk = k.dim(0), Hkv = k.dim(1), D = q.dim(2);
  Tensor64 o({Nq, H, D});
  for (int64_t i = 0; i < Nq; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kh = h / (H / Hkv);
      std::vector<double> s(size_t(Nk), -INFINITY);
      double mx = -INFINITY;
      for (int64_t j = 0; j < Nk; ++j) {
        if (!allowed(i, j)) continue;
        double d = 0;
        for (int64_t e = 0; e < D; ++e)
          d += q.data[size_t((i * H + h) * D + e)] * k.data[size_t((j * Hkv + kh) * D + e)];
        s[size_t(j)] = d * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      if (mx == -INFINITY) continue;
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j < Nk; ++j)
        for (int64_t e = 0; e < D; ++e)
          o.data[size_t((i * H + h) * D + e)] += s[size_t(j)] / sum * v.data[size_t((j * Hkv + kh) * D + e)];
    }
  return o;
}

}  // namespace

TEST(DrafterOps, DflashMaskRangesMatchNaiveMask) {
  std::mt19937 rng(13);
  int checked = 0;
  for (bool causal : {false, true})
    for (int64_t B : {1, 3, 4, 16})
      for (int64_t W : {0, 1, 2, 3, 5, 64})
        for (int64_t S : {1, 6, 20}) {
          std::vector<int64_t> anchors;
          for (int i = 0; i < 3; ++i) anchors.push_back(int64_t(rng() % uint32_t(S + 1)));  // 0..S inclusive
          anchors.push_back(0);
          anchors.push_back(S);
          const int64_t nblocks = int64_t(anchors.size()) + 2;  // 2 padding blocks
          const auto r = cpu::dflash_kv_ranges(anchors, nblocks, B, S, W, causal);
          ASSERT_EQ(int64_t(r.size()), nblocks * B);
          const int64_t Nk = S + nblocks * B;
          for (int64_t i = 0; i < nblocks * B; ++i)
            for (int64_t j = 0; j < Nk; ++j) {
              ASSERT_EQ(range_allowed(r[size_t(i)], j), naive_allowed(anchors, B, S, W, i, j, causal))
                  << "B " << B << " W " << W << " S " << S << " causal " << causal << " row " << i << " kv " << j;
              ++checked;
            }
        }
  EXPECT_GT(checked, 20000);
  // A causal full layer: slot k of a block sees its context and slots 0..k only.
  const auto causal_full = cpu::dflash_kv_ranges({2}, 1, 4, 6, 0, true);
  EXPECT_EQ(causal_full[1].ctx_begin, 0);
  EXPECT_EQ(causal_full[1].ctx_end, 2);
  EXPECT_EQ(causal_full[1].blk_end - causal_full[1].blk_begin, 2);
  EXPECT_EQ(cpu::dflash_kv_ranges({2}, 1, 4, 6, 0, false)[1].blk_end - causal_full[1].blk_begin, 4);
  EXPECT_THROW(cpu::dflash_kv_ranges({7}, 1, 4, 6, 0, false), std::invalid_argument);   // anchor > S
  EXPECT_THROW(cpu::dflash_kv_ranges({-1}, 1, 4, 6, 0, false), std::invalid_argument);  // negative anchor
  EXPECT_THROW(cpu::dflash_kv_ranges({1, 2}, 1, 4, 6, 0, false), std::invalid_argument); // more anchors than blocks
  EXPECT_THROW(cpu::dflash_kv_ranges({1}, 1, 0, 6, 0, false), std::invalid_argument);   // block_size 0
}

TEST(DrafterOps, MaskedAttentionForwardBackward) {
  // S = 5 context tokens, 4 blocks of B = 3 (the last one padding): Nq = 12, Nk = 17; H = 4, Hkv = 2, D = 12.
  const int64_t S = 5, B = 3, H = 4, Hkv = 2, D = 12, nb = 4;
  const std::vector<int64_t> anchors{0, 2, 4};
  const double scale = 1.0 / std::sqrt(double(D));
  double worst_fd = 0, worst_fwd = 0, worst_32 = 0;
  for (int64_t W : {0, 2, 3}) {
    const auto ranges = cpu::dflash_kv_ranges(anchors, nb, B, S, W, false);
    const int64_t Nq = nb * B, Nk = S + nb * B;
    Tensor64 q = randn64({Nq, H, D}, 20), k = randn64({Nk, Hkv, D}, 21), v = randn64({Nk, Hkv, D}, 22),
             R = randn64({Nq, H, D}, 23);
    Tensor64 lse;
    Tensor64 o = cpu::masked_attention_forward(q, k, v, ranges, scale, &lse);
    Tensor64 ref = naive_attention(q, k, v, [&](int64_t i, int64_t j) { return naive_allowed(anchors, B, S, W, i, j); },
                                   scale);
    worst_fwd = std::max(worst_fwd, rel(o.data, ref.data));
    // Padding rows (block 3) see nothing: output 0, lse -inf.
    for (int64_t i = 3 * B; i < Nq; ++i)
      for (int64_t h = 0; h < H; ++h) {
        EXPECT_EQ(lse.data[size_t(i * H + h)], -INFINITY);
        for (int64_t e = 0; e < D; ++e) EXPECT_EQ(o.data[size_t((i * H + h) * D + e)], 0.0);
      }
    Tensor64 dq, dk, dv;
    cpu::masked_attention_backward(q, k, v, o, lse, R, ranges, scale, &dq, &dk, &dv);
    EXPECT_TRUE(all_finite(dq.data) && all_finite(dk.data) && all_finite(dv.data));
    for (int64_t i = 3 * B; i < Nq; ++i)
      for (int64_t e = 0; e < H * D; ++e) EXPECT_EQ(dq.data[size_t(i * H * D + e)], 0.0);
    // Keys of the padding block are seen by nobody: zero dk, dv.
    for (int64_t j = S + 3 * B; j < Nk; ++j)
      for (int64_t e = 0; e < Hkv * D; ++e) {
        EXPECT_EQ(dk.data[size_t(j * Hkv * D + e)], 0.0);
        EXPECT_EQ(dv.data[size_t(j * Hkv * D + e)], 0.0);
      }
    auto loss = [&] { return dot_sum(cpu::masked_attention_forward(q, k, v, ranges, scale, nullptr), R); };
    const double eq = fd_error(q, dq, loss), ek = fd_error(k, dk, loss), ev = fd_error(v, dv, loss);
    report("attention W=" + std::to_string(W) + " dq fd", eq);
    report("attention W=" + std::to_string(W) + " dk fd", ek);
    report("attention W=" + std::to_string(W) + " dv fd", ev);
    worst_fd = std::max({worst_fd, eq, ek, ev});

    Tensor lse32, dq32, dk32, dv32;
    Tensor o32 = cpu::masked_attention_forward(f32(q), f32(k), f32(v), ranges, scale, &lse32);
    cpu::masked_attention_backward(f32(q), f32(k), f32(v), o32, lse32, f32(R), ranges, scale, &dq32, &dk32, &dv32);
    EXPECT_TRUE(all_finite(o32.data) && all_finite(dq32.data) && all_finite(dk32.data) && all_finite(dv32.data));
    worst_32 = std::max({worst_32, rel(o32.data, o.data), rel(dq32.data, dq.data), rel(dk32.data, dk.data),
                         rel(dv32.data, dv.data)});
  }
  report("attention fwd vs naive (all W)", worst_fwd);
  report("attention f32 vs f64 (all W)", worst_32);
  EXPECT_LE(worst_fd, test::kTolFiniteDifference);
  EXPECT_LE(worst_fwd, 1e-13);
  EXPECT_LE(worst_32, test::kTolF32);
}

TEST(DrafterOps, MaskedAttentionAllRowsMaskedIsZeroAndNanFree) {
  Tensor q = f32(randn64({3, 2, 4}, 30)), k = f32(randn64({5, 1, 4}, 31)), v = f32(randn64({5, 1, 4}, 32));
  const std::vector<cpu::KvRanges> none(3);
  Tensor lse, dq, dk, dv;
  Tensor o = cpu::masked_attention_forward(q, k, v, none, 0.5, &lse);
  cpu::masked_attention_backward(q, k, v, o, lse, f32(randn64({3, 2, 4}, 33)), none, 0.5, &dq, &dk, &dv);
  for (const Tensor* t : {&o, &dq, &dk, &dv})
    for (float x : t->data) EXPECT_EQ(x, 0.0f);
  std::vector<cpu::KvRanges> bad(3);
  bad[1].blk_begin = 4;
  bad[1].blk_end = 6;  // past Nk = 5
  EXPECT_THROW(cpu::masked_attention_forward(q, k, v, bad, 0.5, &lse), std::invalid_argument);
  bad[1] = {0, 3, 2, 4};  // overlapping ranges
  EXPECT_THROW(cpu::masked_attention_forward(q, k, v, bad, 0.5, &lse), std::invalid_argument);
}

namespace {
struct NaiveCe {
  double loss = 0;
  std::vector<int32_t> argmax;
  Tensor64 dh;
};
/// Full [M, V] logits in double.
NaiveCe naive_ce(const Tensor64& h, const Tensor64& W, const std::vector<int32_t>& t, const std::vector<double>& w) {
  const int64_t M = h.dim(0), D = h.dim(1), V = W.dim(0);
  NaiveCe r;
  r.dh = Tensor64({M, D});
  double ws = 0;
  for (double x : w) ws += x;
  for (int64_t m = 0; m < M; ++m) {
    std::vector<double> z(static_cast<size_t>(V));
    int32_t am = 0;
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t d = 0; d < D; ++d) z[size_t(v)] += h.data[size_t(m * D + d)] * W.data[size_t(v * D + d)];
      if (z[size_t(v)] > z[size_t(am)]) am = int32_t(v);
    }
    r.argmax.push_back(am);
    if (w[size_t(m)] == 0) continue;
    double sum = 0;
    for (double x : z) sum += std::exp(x - z[size_t(am)]);
    const double lse = z[size_t(am)] + std::log(sum);
    r.loss += w[size_t(m)] * (lse - z[size_t(t[size_t(m)])]) / ws;
    for (int64_t v = 0; v < V; ++v) {
      const double g = w[size_t(m)] / ws * (std::exp(z[size_t(v)] - lse) - (v == t[size_t(m)] ? 1.0 : 0.0));
      for (int64_t d = 0; d < D; ++d) r.dh.data[size_t(m * D + d)] += g * W.data[size_t(v * D + d)];
    }
  }
  return r;
}
}  // namespace

TEST(DrafterOps, ChunkedCrossEntropy) {
  const int64_t M = 7, D = 12, V = 37;
  Tensor64 h = randn64({M, D}, 40), W = randn64({V, D}, 41, 0.5);
  const std::vector<int32_t> t{3, 36, 0, -1, 17, 17, 5};  // row 3 has weight 0: its target is ignored
  std::vector<double> w;
  for (int k = 1; k <= M; ++k) w.push_back(k == 4 ? 0.0 : std::exp(-(k - 1) / 7.0));
  const NaiveCe ref = naive_ce(h, W, t, w);
  Tensor64 dh;
  const auto res = cpu::chunked_cross_entropy(h, W, t, w, 3, 8, &dh);
  EXPECT_NEAR(res.loss, ref.loss, 1e-13 * std::abs(ref.loss));
  EXPECT_EQ(res.argmax, ref.argmax);
  const double ed = rel(dh.data, ref.dh.data);
  report("ce dh vs full logits", ed);
  EXPECT_LE(ed, 1e-13);
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dh.data[size_t(3 * D + d)], 0.0);

  auto loss = [&] { return cpu::chunked_cross_entropy(h, W, t, w, 3, 8, nullptr).loss; };
  const double efd = fd_error(h, dh, loss);
  report("ce dh fd", efd);
  EXPECT_LE(efd, test::kTolFiniteDifference);

  double worst_chunk = 0;
  for (auto [rc, vc] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {2, 5}, {7, 37}, {4, 36}, {100, 100}}) {
    Tensor64 dh2;
    const auto r2 = cpu::chunked_cross_entropy(h, W, t, w, rc, vc, &dh2);
    EXPECT_EQ(r2.argmax, res.argmax);
    worst_chunk = std::max({worst_chunk, std::abs(r2.loss - res.loss) / res.loss, rel(dh2.data, dh.data)});
  }
  report("ce chunk-size dependence", worst_chunk);
  EXPECT_LE(worst_chunk, 1e-14);

  Tensor dh32;
  std::vector<float> w32(w.begin(), w.end());
  const auto r32 = cpu::chunked_cross_entropy(f32(h), f32(W), t, w32, 2, 5, &dh32);
  const double e32 = std::max(std::abs(double(r32.loss) - res.loss) / res.loss, rel(dh32.data, dh.data));
  report("ce f32 vs f64", e32);
  EXPECT_LE(e32, test::kTolF32);
  EXPECT_EQ(r32.argmax, res.argmax);

  // All weights zero: loss 0, dh 0, nothing NaN.
  Tensor dz;
  const auto rz = cpu::chunked_cross_entropy(f32(h), f32(W), t, std::vector<float>(size_t(M), 0.0f), 2, 5, &dz);
  EXPECT_EQ(rz.loss, 0.0f);
  for (float x : dz.data) EXPECT_EQ(x, 0.0f);
  EXPECT_TRUE(all_finite(rz.lse));
  EXPECT_THROW(cpu::chunked_cross_entropy(h, W, {3, 36, 0, 37, 17, 17, 5}, std::vector<double>(size_t(M), 1.0), 2,
                                          5, nullptr),
               std::invalid_argument);
  EXPECT_THROW(cpu::chunked_cross_entropy(h, W, t, w, 0, 5, nullptr), std::invalid_argument);
}
