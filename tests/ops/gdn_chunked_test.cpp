// cpu::gated_delta_rule_chunked, the stage-by-stage chunked reference, against the token recurrence
// (cpu::gated_delta_rule_recurrent): the outputs and final state, the state before each chunk and U
// against the recurrence's token states, and w / u against the equations that define them.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ops/gated_delta_rule.h"
#include "ops/norm.h"
#include "test_util.h"

using namespace dflash;

namespace {

/// Random inputs of the recurrence as gdn_prepare makes them: q, k l2-normalized (q times 1 / sqrt(dk)),
/// v ~ N(0, 1), log decays g in [-0.6, -0.01], beta in (0, 1), and an initial state ~ N(0, 0.1^2).
struct Inputs {
  Tensor q, k, v, g, beta, init;
  std::vector<int64_t> cu{0};
  Inputs(const std::vector<int64_t>& lens, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, uint64_t seed) {
    for (int64_t n : lens) cu.push_back(cu.back() + n);
    const int64_t T = cu.back();
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> ud(0.f, 1.f);
    q = Tensor({T, Hk, dk}), k = Tensor({T, Hk, dk}), v = Tensor({T, Hv, dv});
    g = Tensor({T, Hv}), beta = Tensor({T, Hv}), init = Tensor({int64_t(lens.size()), Hv, dk, dv});
    for (Tensor* t : {&q, &k, &v}) for (float& x : t->data) x = nd(rng);
    cpu::l2_norm(q.ptr(), T * Hk, dk);
    cpu::l2_norm(k.ptr(), T * Hk, dk);
    for (float& x : q.data) x /= std::sqrt(float(dk));
    for (float& x : g.data) x = -0.01f - 0.59f * ud(rng);
    for (float& x : beta.data) x = 0.02f + 0.96f * ud(rng);
    for (float& x : init.data) x = 0.1f * nd(rng);
  }
};

struct Shape {
  std::vector<int64_t> lens;
  int64_t Hk, Hv, dk, dv, chunk;
};

// Packed sequences around the chunk size (one empty: its initial state passes through), GVA, head
// dims apart, chunks of 64 (the GPU's), 16 and 1 (the recurrence itself).
const Shape kShapes[] = {{{1, 63, 64, 0, 65, 130}, 2, 4, 16, 12, 64}, {{37, 16, 50}, 1, 3, 8, 20, 16},
                         {{9, 4}, 2, 2, 4, 4, 1}};

std::string name(const Shape& s) {
  return "Hk " + std::to_string(s.Hk) + " Hv " + std::to_string(s.Hv) + " chunk " + std::to_string(s.chunk);
}

}  // namespace

TEST(CpuGdnChunked, OutputAndFinalStateMatchTheRecurrence) {
  for (const Shape& s : kShapes) {
    const Inputs in(s.lens, s.Hk, s.Hv, s.dk, s.dv, 7);
    Tensor want_state;
    const Tensor want = cpu::gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, 1.f, false, in.cu, &in.init,
                                                        &want_state);
    const cpu::GdnChunkedTrace got = cpu::gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, in.cu, &in.init,
                                                                   s.chunk);
    EXPECT_EQ(got.o.shape, want.shape) << name(s);
    EXPECT_LE(test::rel_l2(got.o.data, want.data), test::kTolF32) << name(s);
    EXPECT_LE(test::rel_l2(got.final_state.data, want_state.data), test::kTolF32) << name(s);
  }
}

TEST(CpuGdnChunked, StatesAndUMatchTheRecurrencesTokenStates) {
  for (const Shape& s : kShapes) {
    const Inputs in(s.lens, s.Hk, s.Hv, s.dk, s.dv, 8);
    Tensor final_state, token_states;
    cpu::gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, 1.f, false, in.cu, &in.init, &final_state,
                                    &token_states);
    const cpu::GdnChunkedTrace got = cpu::gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, in.cu, &in.init,
                                                                   s.chunk);
    const int64_t T = in.cu.back(), Hv = s.Hv, dk = s.dk, dv = s.dv, rep = s.Hv / s.Hk, sz = dk * dv;
    // The state before token t of sequence sq, head h: the token states of t - 1, or the initial state.
    auto before = [&](int64_t sq, int64_t t, int64_t h) {
      return t == in.cu[size_t(sq)] ? in.init.ptr() + (sq * Hv + h) * sz : token_states.ptr() + ((t - 1) * Hv + h) * sz;
    };
    std::vector<float> want_h, want_u;
    int64_t chunks = 0;
    for (int64_t sq = 0; sq + 1 < int64_t(in.cu.size()); ++sq)
      for (int64_t c0 = in.cu[size_t(sq)]; c0 < in.cu[size_t(sq) + 1]; c0 += s.chunk, ++chunks)
        for (int64_t h = 0; h < Hv; ++h) want_h.insert(want_h.end(), before(sq, c0, h), before(sq, c0, h) + sz);
    for (int64_t sq = 0; sq + 1 < int64_t(in.cu.size()); ++sq)
      for (int64_t t = in.cu[size_t(sq)]; t < in.cu[size_t(sq) + 1]; ++t)
        for (int64_t h = 0; h < Hv; ++h) {  // U_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
          const float* S = before(sq, t, h);
          const float* kt = in.k.ptr() + (t * s.Hk + h / rep) * dk;
          const double decay = std::exp(double(in.g.data[size_t(t * Hv + h)])), b = in.beta.data[size_t(t * Hv + h)];
          for (int64_t n = 0; n < dv; ++n) {
            double sk = 0;
            for (int64_t m = 0; m < dk; ++m) sk += double(S[m * dv + n]) * kt[m];
            want_u.push_back(float(b * (in.v.data[size_t((t * Hv + h) * dv + n)] - decay * sk)));
          }
        }
    ASSERT_EQ(got.h.shape, (std::vector<int64_t>{chunks, Hv, dk, dv})) << name(s);
    ASSERT_EQ(got.v_new.shape, (std::vector<int64_t>{T, Hv, dv})) << name(s);
    EXPECT_LE(test::rel_l2(got.h.data, want_h), test::kTolF32) << name(s);
    EXPECT_LE(test::rel_l2(got.v_new.data, want_u), test::kTolF32) << name(s);
  }
}

TEST(CpuGdnChunked, PrepareSolvesItsEquations) {
  // Per chunk: G is the running sum of g; (I + A) w = diag(beta exp(G)) K and (I + A) u = diag(beta) V
  // with A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i); P_ij = exp(G_i - G_j) q_i.k_j on and below the
  // diagonal, zero elsewhere.
  const Shape s = kShapes[0];
  const Inputs in(s.lens, s.Hk, s.Hv, s.dk, s.dv, 9);
  const cpu::GdnChunkedTrace got = cpu::gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, in.cu, &in.init);
  const int64_t Hv = s.Hv, dk = s.dk, dv = s.dv, C = s.chunk, rep = s.Hv / s.Hk;
  std::vector<double> lhs_w, rhs_w, lhs_u, rhs_u, got_G, want_G, want_P;  // per chunk, head, row
  for (int64_t sq = 0; sq + 1 < int64_t(in.cu.size()); ++sq)
    for (int64_t c0 = in.cu[size_t(sq)]; c0 < in.cu[size_t(sq) + 1]; c0 += C) {
      const int64_t L = std::min(C, in.cu[size_t(sq) + 1] - c0);
      for (int64_t h = 0; h < Hv; ++h) {
        auto at = [&](const Tensor& x, int64_t i) { return double(x.data[size_t((c0 + i) * Hv + h)]); };
        auto key = [&](int64_t i) { return in.k.ptr() + ((c0 + i) * s.Hk + h / rep) * dk; };
        auto qry = [&](int64_t i) { return in.q.ptr() + ((c0 + i) * s.Hk + h / rep) * dk; };
        auto dot = [&](const float* x, const float* y) {
          double d = 0;
          for (int64_t m = 0; m < dk; ++m) d += double(x[m]) * y[m];
          return d;
        };
        double run = 0;
        for (int64_t i = 0; i < L; ++i) {
          want_G.push_back(run += at(in.g, i));
          got_G.push_back(got.G.data[size_t((c0 + i) * Hv + h)]);
        }
        for (int64_t i = 0; i < L; ++i) {
          const double Gi = got.G.data[size_t((c0 + i) * Hv + h)];
          for (int64_t m = 0; m < dk; ++m) {
            double x = got.w.data[size_t(((c0 + i) * Hv + h) * dk + m)];
            for (int64_t j = 0; j < i; ++j)
              x += at(in.beta, i) * std::exp(Gi - got.G.data[size_t((c0 + j) * Hv + h)]) * dot(key(i), key(j)) *
                   got.w.data[size_t(((c0 + j) * Hv + h) * dk + m)];
            lhs_w.push_back(x);
            rhs_w.push_back(at(in.beta, i) * std::exp(Gi) * key(i)[m]);
          }
          for (int64_t n = 0; n < dv; ++n) {
            double x = got.u.data[size_t(((c0 + i) * Hv + h) * dv + n)];
            for (int64_t j = 0; j < i; ++j)
              x += at(in.beta, i) * std::exp(Gi - got.G.data[size_t((c0 + j) * Hv + h)]) * dot(key(i), key(j)) *
                   got.u.data[size_t(((c0 + j) * Hv + h) * dv + n)];
            lhs_u.push_back(x);
            rhs_u.push_back(at(in.beta, i) * in.v.data[size_t(((c0 + i) * Hv + h) * dv + n)]);
          }
        }
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < C; ++j)
            want_P.push_back(i < L && j <= i ? std::exp(want_G[want_G.size() - size_t(L) + size_t(i)] -
                                                        want_G[want_G.size() - size_t(L) + size_t(j)]) *
                                                   dot(qry(i), key(j))
                                             : 0.0);
      }
    }
  EXPECT_LE(test::rel_l2(got_G, want_G), test::kTolF32);
  EXPECT_LE(test::rel_l2(lhs_w, rhs_w), test::kTolF32);
  EXPECT_LE(test::rel_l2(lhs_u, rhs_u), test::kTolF32);
  EXPECT_LE(test::rel_l2(got.P.data, want_P), test::kTolF32);
}

TEST(CpuGdnChunked, RejectsBadArguments) {
  const Inputs in({5}, 1, 1, 4, 4, 1);
  EXPECT_THROW(cpu::gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, in.cu, nullptr, 0),
               std::invalid_argument);  // chunk 0
  EXPECT_THROW(cpu::gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, {0, 4}, nullptr),
               std::invalid_argument);  // cu_seqlens short of T
  const Tensor bad_state({2, 1, 4, 4});
  EXPECT_THROW(cpu::gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, in.cu, &bad_state),
               std::invalid_argument);  // two initial states for one sequence
}
