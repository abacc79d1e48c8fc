// Reference ops against hand-computed values and against their own per-sequence runs (packing).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/gated_delta_rule.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "models/hf_config.h"
#include "io/json_file.h"
#include "ops/rope.h"
#include "test_util.h"

using namespace dflash;

namespace {
Tensor randn(std::vector<int64_t> shape, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  Tensor t(std::move(shape));
  for (auto& x : t.data) x = nd(rng);
  return t;
}
}  // namespace

TEST(Ops, LinearMatchesNaiveProduct) {
  Tensor x = randn({5, 7}, 1), w = randn({3, 7}, 2);
  Tensor y = cpu::linear(x, w);
  ASSERT_EQ(y.shape, (std::vector<int64_t>{5, 3}));
  for (int t = 0; t < 5; ++t)
    for (int o = 0; o < 3; ++o) {
      double acc = 0;
      for (int i = 0; i < 7; ++i) acc += double(x.data[t * 7 + i]) * w.data[o * 7 + i];
      EXPECT_NEAR(y.data[t * 3 + o], acc, 1e-5);
    }
  EXPECT_THROW(cpu::linear(x, randn({3, 6}, 3)), std::invalid_argument);
}

TEST(Ops, EmbeddingRejectsOutOfRangeIds) {
  Tensor table = randn({4, 3}, 1);
  EXPECT_EQ(cpu::embedding(table, {2}).data, std::vector<float>(table.data.begin() + 6, table.data.begin() + 9));
  EXPECT_THROW(cpu::embedding(table, {4}), std::out_of_range);
  EXPECT_THROW(cpu::embedding(table, {-1}), std::out_of_range);
}

TEST(Ops, RmsNormPlainAndZeroCentered) {
  Tensor x({1, 2});
  x.data = {3.0f, 4.0f};  // mean square 12.5
  Tensor w({2});
  w.data = {2.0f, 0.5f};
  Tensor a = x, b = x;
  cpu::rms_norm(a, w, 0.0, false);
  cpu::rms_norm(b, w, 0.0, true);
  const float s = 1.0f / std::sqrt(12.5f);
  EXPECT_NEAR(a.data[0], 3 * s * 2.0f, 1e-6);
  EXPECT_NEAR(a.data[1], 4 * s * 0.5f, 1e-6);
  EXPECT_NEAR(b.data[0], 3 * s * 3.0f, 1e-6);
  EXPECT_NEAR(b.data[1], 4 * s * 1.5f, 1e-6);
}

TEST(Ops, GatedRmsNormAppliesSiluGate) {
  Tensor x({1, 2}), z({1, 2}), w({2});
  x.data = {1.0f, -1.0f};
  z.data = {0.0f, 2.0f};
  w.data = {1.0f, 3.0f};
  cpu::gated_rms_norm(x, z, w, 0.0);
  EXPECT_NEAR(x.data[0], 0.0f, 1e-7);  // silu(0) = 0
  EXPECT_NEAR(x.data[1], -3.0f * cpu::silu(2.0f), 1e-6);
}

TEST(Ops, RopeRotatesPairsAndKeepsPassThroughDims) {
  RopeSpec r;
  r.theta = 100.0;
  const auto inv = cpu::rope_inv_freq(r, 4);  // [1, 0.1]
  EXPECT_NEAR(inv[0], 1.0f, 1e-7);
  EXPECT_NEAR(inv[1], 0.1f, 1e-7);
  Tensor x({2, 1, 6});
  x.data = {1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6};
  cpu::apply_rope(x, {0, 1}, inv, 4);
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(x.data[i], float(i + 1));  // position 0: identity
  // position 1: pairs (0,2) by angle 1, (1,3) by angle 0.1; dims 4,5 pass through.
  EXPECT_NEAR(x.data[6], 1 * std::cos(1.f) - 3 * std::sin(1.f), 1e-6);
  EXPECT_NEAR(x.data[8], 3 * std::cos(1.f) + 1 * std::sin(1.f), 1e-6);
  EXPECT_NEAR(x.data[7], 2 * std::cos(.1f) - 4 * std::sin(.1f), 1e-6);
  EXPECT_NEAR(x.data[9], 4 * std::cos(.1f) + 2 * std::sin(.1f), 1e-6);
  EXPECT_FLOAT_EQ(x.data[10], 5.0f);
  EXPECT_FLOAT_EQ(x.data[11], 6.0f);
  r.type = "longrope";
  EXPECT_THROW(cpu::rope_inv_freq(r, 4), std::invalid_argument);
}

// Frequencies and the cos / sin scale of scaled RoPE (yarn, llama3) against transformers' own
// ROPE_INIT_FUNCTIONS (tests/fixtures/rope/golden.json, made by scripts/make_rope_golden.py), read
// through the config reader as a config.json gives them.
TEST(Ops, RopeFrequenciesMatchTransformers) {
  const auto golden = read_json_file((test::fixtures_dir() / "rope" / "golden.json").string());
  ASSERT_GE(golden["cases"].size(), 5u);
  int yarn = 0;
  for (const auto& c : golden["cases"]) {
    const nlohmann::json cfg = {{"rope_theta", c["rope_theta"]}, {"rope_scaling", c["rope_scaling"]},
                                {"max_position_embeddings", c["max_position_embeddings"]}};
    RopeSpec r;
    hf::read_rope(cfg, r, hf::DenseDefaults{}, "golden");
    const int64_t hd = c["head_dim"];
    const std::vector<double> want = c["inv_freq"].get<std::vector<double>>();
    const std::vector<float> f32 = cpu::rope_inv_freq(r, hd);
    const std::vector<double> f64 = cpu::rope_frequencies<double>(r, hd);
    ASSERT_EQ(f32.size(), want.size()) << c["rope_scaling"].dump();
    for (size_t i = 0; i < want.size(); ++i) {
      // transformers computes in float32. The float path does the same operations: within a few ulp.
      // The exact path differs by float32's rounding of the golden: a blend of an interpolated and
      // an extrapolated frequency `factor` apart rounds by up to a few ulp of the larger one.
      EXPECT_NEAR(f32[i], want[i], 4 * 0x1p-24 * want[i]) << c["rope_scaling"].dump() << " i " << i;
      EXPECT_NEAR(f64[i], want[i], 4 * 0x1p-24 * r.factor * want[i]) << c["rope_scaling"].dump() << " i " << i;
    }
    EXPECT_NEAR(cpu::rope_attention_factor(r), c["attention_factor"].get<double>(), 1e-12) << c["rope_scaling"].dump();
    yarn += r.type == "yarn";
  }
  EXPECT_EQ(yarn, 4);
}

TEST(Ops, AttentionFirstTokenReturnsItsValueAndGqaSharesKv) {
  Tensor q = randn({3, 4, 8}, 1), k = randn({3, 2, 8}, 2), v = randn({3, 2, 8}, 3);
  Tensor o = cpu::causal_attention(q, k, v, {0, 3}, 0.35f);
  for (int h = 0; h < 4; ++h)
    for (int d = 0; d < 8; ++d) EXPECT_NEAR(o.data[h * 8 + d], v.data[(h / 2) * 8 + d], 1e-6);
  // Token 2, head 3 by hand (kv head 1).
  double p[3], mx = -1e30, sum = 0;
  for (int j = 0; j < 3; ++j) {
    double dot = 0;
    for (int d = 0; d < 8; ++d) dot += double(q.data[(2 * 4 + 3) * 8 + d]) * k.data[(j * 2 + 1) * 8 + d];
    p[j] = dot * 0.35;
    mx = std::max(mx, p[j]);
  }
  for (double& x : p) sum += (x = std::exp(x - mx));
  for (int d = 0; d < 8; ++d) {
    double e = 0;
    for (int j = 0; j < 3; ++j) e += p[j] / sum * v.data[(j * 2 + 1) * 8 + d];
    EXPECT_NEAR(o.data[(2 * 4 + 3) * 8 + d], e, 1e-5);
  }
}

TEST(Ops, AttentionPackedEqualsSeparate) {
  Tensor q = randn({9, 4, 8}, 4), k = randn({9, 2, 8}, 5), v = randn({9, 2, 8}, 6);
  const std::vector<int64_t> cu{0, 4, 4, 9};  // includes an empty sequence
  Tensor packed = cpu::causal_attention(q, k, v, cu, 0.3f);
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s] == cu[s + 1]) continue;
    Tensor one = cpu::causal_attention(slice_rows(q, cu[s], cu[s + 1]), slice_rows(k, cu[s], cu[s + 1]),
                                       slice_rows(v, cu[s], cu[s + 1]), {0, cu[s + 1] - cu[s]}, 0.3f);
    EXPECT_EQ(slice_rows(packed, cu[s], cu[s + 1]).data, one.data);
  }
  EXPECT_THROW(cpu::causal_attention(q, k, v, {0, 4, 8}, 0.3f), std::invalid_argument);
  EXPECT_THROW(cpu::causal_attention(q, k, v, {0, 5, 4, 9}, 0.3f), std::invalid_argument);
}

TEST(Ops, ConvWindowResetsAtSequenceBoundary) {
  Tensor x({5, 1}), w({1, 3});
  x.data = {1, 2, 3, 4, 5};
  w.data = {0.5f, -1.0f, 2.0f};  // y[t] = silu(0.5 x[t-2] - x[t-1] + 2 x[t])
  Tensor y = cpu::causal_conv1d_silu(x, w, {0, 3, 5});
  const float e[5] = {cpu::silu(2), cpu::silu(-1 + 4), cpu::silu(0.5f - 2 + 6), cpu::silu(8), cpu::silu(-4 + 10)};
  for (int t = 0; t < 5; ++t) EXPECT_NEAR(y.data[t], e[t], 1e-6) << t;
}

TEST(Ops, GatedDeltaRuleMatchesClosedFormAndPacking) {
  // One token: S = k u^T with u = beta v (S starts at 0), o = S^T q = (k.q) beta v.
  const int64_t Hk = 2, Hv = 4, dk = 3, dv = 5;
  Tensor q = randn({1, Hk, dk}, 1), k = randn({1, Hk, dk}, 2), v = randn({1, Hv, dv}, 3);
  Tensor g({1, Hv}), beta({1, Hv});
  for (int h = 0; h < Hv; ++h) {
    g.data[h] = -0.5f * h;
    beta.data[h] = 0.25f * (h + 1);
  }
  Tensor fin;
  Tensor o = cpu::gated_delta_rule_recurrent(q, k, v, g, beta, 0.7f, false, {0, 1}, nullptr, &fin);
  for (int h = 0; h < Hv; ++h) {
    const int kh = h / 2;
    double kq = 0;
    for (int i = 0; i < dk; ++i) kq += double(k.data[kh * dk + i]) * q.data[kh * dk + i] * 0.7;
    for (int j = 0; j < dv; ++j) {
      EXPECT_NEAR(o.data[h * dv + j], kq * beta.data[h] * v.data[h * dv + j], 1e-5);
      for (int i = 0; i < dk; ++i)
        EXPECT_NEAR(fin.data[(h * dk + i) * dv + j], k.data[kh * dk + i] * beta.data[h] * v.data[h * dv + j], 1e-6);
    }
  }
  // Packed == separate, with non-zero initial states and l2norm on.
  const int64_t T = 11;
  Tensor Q = randn({T, Hk, dk}, 4), K = randn({T, Hk, dk}, 5), V = randn({T, Hv, dv}, 6);
  Tensor G = randn({T, Hv}, 7), B = randn({T, Hv}, 8);
  for (auto& x : G.data) x = -std::abs(x) * 3;
  for (auto& x : B.data) x = cpu::sigmoid(x);
  const std::vector<int64_t> cu{0, 1, 7, 11};
  Tensor init = randn({3, Hv, dk, dv}, 9, 0.5f), fin_packed;
  Tensor packed = cpu::gated_delta_rule_recurrent(Q, K, V, G, B, 0.5f, true, cu, &init, &fin_packed);
  for (int s = 0; s < 3; ++s) {
    Tensor init1 = slice_rows(init, s, s + 1), fin1;
    Tensor one = cpu::gated_delta_rule_recurrent(slice_rows(Q, cu[s], cu[s + 1]), slice_rows(K, cu[s], cu[s + 1]),
                                                 slice_rows(V, cu[s], cu[s + 1]), slice_rows(G, cu[s], cu[s + 1]),
                                                 slice_rows(B, cu[s], cu[s + 1]), 0.5f, true, {0, cu[s + 1] - cu[s]},
                                                 &init1, &fin1);
    EXPECT_EQ(slice_rows(packed, cu[s], cu[s + 1]).data, one.data);
    EXPECT_EQ(slice_rows(fin_packed, s, s + 1).data, fin1.data);
  }
}

TEST(Ops, GatedDeltaRuleStateDecaysAndCorrects) {
  // beta = 1 with a unit key writes v exactly: a second write of the same key replaces the value
  // (delta rule), and g decays the old state first.
  Tensor q({2, 1, 2}), k({2, 1, 2}), v({2, 1, 1}), g({2, 1}), b({2, 1});
  q.data = {1, 0, 1, 0};
  k.data = {1, 0, 1, 0};
  v.data = {3, 5};
  g.data = {0.0f, std::log(0.5f)};
  b.data = {1, 1};
  Tensor o = cpu::gated_delta_rule_recurrent(q, k, v, g, b, 1.0f, false, {0, 2}, nullptr, nullptr);
  EXPECT_NEAR(o.data[0], 3.0f, 1e-6);
  EXPECT_NEAR(o.data[1], 5.0f, 1e-6);  // 0.5*3 decayed, then corrected to 5
}

TEST(Ops, RopeLlama3ScalingMatchesFormula) {
  // transformers _compute_llama3_parameters, evaluated here in double.
  RopeSpec r;
  r.type = "llama3";
  r.theta = 500000.0;
  r.factor = 8.0;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = 8192;
  const int64_t dim = 128;
  const auto inv = cpu::rope_inv_freq(r, dim);
  const double pi = 3.14159265358979323846, low_wl = 8192 / 1.0, high_wl = 8192 / 4.0;
  int scaled = 0, smoothed = 0, kept = 0;
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double f = 1.0 / std::pow(500000.0, double(2 * i) / dim), wl = 2 * pi / f;
    double want = f;
    if (wl > low_wl) {
      want = f / 8.0;
      ++scaled;
    } else if (wl >= high_wl) {
      const double s = (8192 / wl - 1.0) / (4.0 - 1.0);
      want = (1 - s) * f / 8.0 + s * f;
      ++smoothed;
    } else {
      ++kept;
    }
    EXPECT_NEAR(inv[size_t(i)], want, 2e-6 * want) << i;
  }
  EXPECT_GT(scaled, 0);  // all three regimes are exercised
  EXPECT_GT(smoothed, 0);
  EXPECT_GT(kept, 0);
}
