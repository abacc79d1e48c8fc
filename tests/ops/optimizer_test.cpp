// AdamW + global-norm clipping (src/ops/optimizer.h) against the 3-step PyTorch golden
// (tests/fixtures/drafter, scripts/dflash_reference.py make_golden), in float32 and float64, plus
// unit checks of the schedule, clipping and gradient accumulation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "io/safetensors.h"
#include "models/drafter.h"
#include "test_util.h"
#include "ops/optimizer.h"
#include "train/schedule.h"

using namespace dflash;

namespace {

using test::read_f64;
using test::read_i64;
using test::read_tensor;
using test::rel_l2;

std::string dir() { return (test::fixtures_dir() / "drafter").string(); }

template <typename T>
std::vector<NamedSpan<T>> spans(DrafterWeights<T>& w) {
  std::vector<NamedSpan<T>> r;
  for (auto& [name, t] : w.named()) r.push_back({name, std::span<T>(t->data)});
  return r;
}
template <typename T>
std::vector<NamedSpan<const T>> const_spans(const DrafterWeights<T>& w) {
  std::vector<NamedSpan<const T>> r;
  for (const auto& [name, t] : w.named()) r.push_back({name, std::span<const T>(t->data)});
  return r;
}

/// 3 steps of drafter_step + clip + AdamW on the golden batch (golden_meta.json: lr 6e-4 constant,
/// betas (0.9, 0.999), eps 1e-8, wd 0, max_norm 1.0, gamma 2.0).
template <typename T>
void run_golden(double tol_loss, double tol_norm, double tol_after, double tol_update) {
  const char* tag = sizeof(T) == 8 ? "f64" : "f32";
  DrafterConfig cfg;
  DrafterWeights<T> w = load_drafter_weights<T>((std::filesystem::path(dir()) / "init").string(), &cfg);
  const DrafterWeights<T> w0 = w;
  const SafetensorsFile in((std::filesystem::path(dir()) / "inputs.safetensors").string());
  const BasicTensor<T> taps = read_tensor<T>(in, "taps"), embed = read_tensor<T>(in, "embed_tokens"),
                       lm_head = read_tensor<T>(in, "lm_head");
  DrafterSequence<T> seq;
  seq.taps = &taps;
  seq.embed = &embed;
  seq.lm_head = &lm_head;
  seq.ids = read_i64(in, "ids");
  seq.loss_mask = read_i64(in, "loss_mask");
  const std::vector<int64_t> anchors = read_i64(in, "anchors");
  seq.num_blocks = int64_t(anchors.size());
  for (int64_t a : anchors)
    if (a >= 0) seq.anchors.push_back(a);
  seq.gamma = 2.0;

  const SafetensorsFile g((std::filesystem::path(dir()) / "golden.safetensors").string());
  const std::vector<double> losses = read_f64(g, "step_losses"), norms = read_f64(g, "grad_norm_preclip"),
                            coefs = read_f64(g, "clip_coef");
  AdamWOptions o;
  o.lr = 6e-4;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = 0.0;
  AdamW<T> opt(spans(w), o);
  for (int step = 0; step < 4; ++step) {
    DrafterStepOptions so;
    so.backward = step < 3;
    DrafterStepResult<T> r = drafter_step(cfg, w, seq, so);
    const double le = std::abs(double(r.loss) - losses[size_t(step)]) / std::abs(losses[size_t(step)]);
    EXPECT_LE(le, tol_loss) << "step " << step << " loss " << r.loss << " vs " << losses[size_t(step)];
    std::printf("[adamw %s] step %d loss %.15f rel err %.3e\n", tag, step, double(r.loss), le);
    if (step == 3) break;
    const ClipResult c = clip_grad_norm(spans(r.grads), 1.0);
    const double ne = std::abs(c.norm - norms[size_t(step)]) / norms[size_t(step)];
    const double ce = std::abs(c.coef - coefs[size_t(step)]) / coefs[size_t(step)];
    EXPECT_LE(ne, tol_norm) << "step " << step;
    EXPECT_LE(ce, tol_norm) << "step " << step;
    std::printf("[adamw %s] step %d grad norm %.12f (rel %.3e) clip %.12f (rel %.3e)\n", tag, step, c.norm, ne,
                c.coef, ce);
    opt.step(spans(w), const_spans(r.grads));
  }
  EXPECT_EQ(opt.step_count(), 3);
  double worst = 0, worst_update = 0;
  const auto init = w0.named();
  const auto fin = w.named();
  for (size_t i = 0; i < fin.size(); ++i) {
    const std::string& name = fin[i].first;
    const std::vector<double> want = read_f64(g, "after3." + name);
    ASSERT_EQ(want.size(), fin[i].second->data.size()) << name;
    const double e = rel_l2(fin[i].second->data, want);
    worst = std::max(worst, e);
    EXPECT_LE(e, tol_after) << name;
    // The update itself (after3 - init), norm-wise: a much stricter view of the optimizer.
    std::vector<double> du(want.size()), dw(want.size());
    for (size_t j = 0; j < want.size(); ++j) {
      du[j] = double(fin[i].second->data[j]) - double(init[i].second->data[j]);
      dw[j] = want[j] - double(init[i].second->data[j]);
    }
    const double eu = rel_l2(du, dw);
    worst_update = std::max(worst_update, eu);
    EXPECT_LE(eu, tol_update) << name << " update";
  }
  std::printf("[adamw %s] after 3 steps: worst per-tensor rel L2 %.3e, worst update rel L2 %.3e\n", tag, worst,
              worst_update);
}

}  // namespace

TEST(AdamWGolden, ThreeStepsFloat32) { run_golden<float>(1e-5, 1e-5, 1e-5, 1e-3); }

TEST(AdamWGolden, ThreeStepsFloat64) { run_golden<double>(1e-12, 1e-12, 1e-9, 1e-10); }

TEST(AdamW, MatchesFormulaWithWeightDecay) {
  // Two steps by hand (torch.optim.AdamW semantics) on 2 elements, wd 0.1.
  std::vector<double> p = {1.0, -2.0}, g1 = {0.5, -0.25}, g2 = {-0.1, 0.3};
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  AdamW<double> opt({"x"}, {2}, o);
  std::vector<double> ref = p, m(2, 0), v(2, 0);
  for (int t = 1; t <= 2; ++t) {
    const std::vector<double>& g = t == 1 ? g1 : g2;
    opt.step({{"x", std::span<double>(p)}}, {{"x", std::span<const double>(g)}});
    for (int j = 0; j < 2; ++j) {
      ref[j] *= 1 - o.lr * o.weight_decay;
      m[j] = 0.9 * m[j] + 0.1 * g[j];
      v[j] = 0.999 * v[j] + 0.001 * g[j] * g[j];
      const double mh = m[j] / (1 - std::pow(0.9, t)), vh = v[j] / (1 - std::pow(0.999, t));
      ref[j] -= o.lr * mh / (std::sqrt(vh) + o.eps);
    }
    for (int j = 0; j < 2; ++j) EXPECT_NEAR(p[j], ref[j], 1e-15) << "t " << t;
  }
  EXPECT_EQ(opt.step_count(), 2);
  EXPECT_NEAR(opt.exp_avg()[0][0], m[0], 1e-15);
  EXPECT_NEAR(opt.exp_avg_sq()[0][1], v[1], 1e-15);
  // state round trip
  AdamW<double> opt2({"x"}, {2}, o);
  opt2.set_state(opt.step_count(), opt.exp_avg(), opt.exp_avg_sq());
  std::vector<double> pa = p, pb = p;
  opt.step({{"x", std::span<double>(pa)}}, {{"x", std::span<const double>(g1)}});
  opt2.step({{"x", std::span<double>(pb)}}, {{"x", std::span<const double>(g1)}});
  EXPECT_EQ(pa, pb);
  EXPECT_THROW(opt2.set_state(1, {{0.0}}, {{0.0}}), std::invalid_argument);
  // mismatched names / sizes
  std::vector<double> bad(3);
  EXPECT_THROW(opt.step({{"x", std::span<double>(bad)}}, {{"x", std::span<const double>(bad)}}), std::invalid_argument);
  EXPECT_THROW(opt.step({{"y", std::span<double>(pa)}}, {{"y", std::span<const double>(g1)}}), std::invalid_argument);
}

TEST(ClipGradNorm, TorchSemantics) {
  std::vector<float> a = {3, 0}, b = {0, 4};
  std::vector<NamedSpan<float>> g = {{"a", std::span<float>(a)}, {"b", std::span<float>(b)}};
  ClipResult c = clip_grad_norm(g, 1.0);
  EXPECT_DOUBLE_EQ(c.norm, 5.0);
  EXPECT_DOUBLE_EQ(c.coef, 1.0 / (5.0 + 1e-6));
  EXPECT_FLOAT_EQ(a[0], float(3.0 / (5.0 + 1e-6)));
  EXPECT_FLOAT_EQ(b[1], float(4.0 / (5.0 + 1e-6)));
  // below max_norm: coef 1, unchanged
  std::vector<float> s = {0.1f, 0.2f};
  const std::vector<float> s0 = s;
  c = clip_grad_norm(std::vector<NamedSpan<float>>{{"s", std::span<float>(s)}}, 1.0);
  EXPECT_EQ(c.coef, 1.0);
  EXPECT_EQ(s, s0);
  // non-finite: reported, untouched
  std::vector<float> n = {NAN, 1.0f};
  c = clip_grad_norm(std::vector<NamedSpan<float>>{{"n", std::span<float>(n)}}, 1.0);
  EXPECT_TRUE(std::isnan(c.norm));
  EXPECT_EQ(n[1], 1.0f);
}

TEST(GradAccumulation, AverageOfMicroBatches) {
  std::vector<double> acc(3, 0.0);
  const std::vector<std::vector<double>> micro = {{1, 2, 3}, {3, 2, 1}, {2, 5, -1}, {-2, 3, 1}};
  for (const auto& g : micro) accumulate_scaled(std::span<double>(acc), std::span<const double>(g), 1.0 / 4);
  EXPECT_DOUBLE_EQ(acc[0], 1.0);
  EXPECT_DOUBLE_EQ(acc[1], 3.0);
  EXPECT_DOUBLE_EQ(acc[2], 1.0);
  std::vector<double> small(2);
  EXPECT_THROW(accumulate_scaled(std::span<double>(small), std::span<const double>(micro[0]), 1.0),
               std::invalid_argument);
}

TEST(WarmupCosineSchedule, HuggingFaceFormula) {
  WarmupCosineSchedule s;
  s.peak_lr = 6e-4;
  s.total_steps = 100;
  s.warmup_ratio = 0.04;
  EXPECT_EQ(s.warmup_steps(), 4);  // math.ceil(100 * 0.04)
  EXPECT_EQ(s.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr(1), 6e-4 * 0.25);
  EXPECT_DOUBLE_EQ(s.lr(3), 6e-4 * 0.75);
  EXPECT_DOUBLE_EQ(s.lr(4), 6e-4);  // end of warmup = peak
  EXPECT_DOUBLE_EQ(s.lr(52), 6e-4 * 0.5);  // half-way through the cosine
  EXPECT_NEAR(s.lr(28), 6e-4 * 0.5 * (1 + std::cos(M_PI * 24.0 / 96.0)), 1e-18);
  EXPECT_NEAR(s.lr(99), 6e-4 * 0.5 * (1 + std::cos(M_PI * 95.0 / 96.0)), 1e-18);
  EXPECT_EQ(s.lr(100), 0.0);
  EXPECT_EQ(s.lr(150), 0.0);  // clamped past the end
  s.total_steps = 10;  // ceil(0.4) = 1
  EXPECT_EQ(s.warmup_steps(), 1);
  EXPECT_EQ(s.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr(1), 6e-4);
  s.warmup_ratio = 0;
  EXPECT_EQ(s.warmup_steps(), 0);
  EXPECT_DOUBLE_EQ(s.lr(0), 6e-4);
}
