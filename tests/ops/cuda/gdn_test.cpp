// The GatedDeltaNet kernels against the CPU references (src/ops/cpu/gated_delta_rule.cpp, norm.cpp) on
// the same inputs: conv1d + SiLU, the recurrence's inputs, the chunked gated delta rule (T = 1, 63, 64,
// 65, 127, 4097, packed sequences, GVA, a non-zero initial state, the final state), the gated RMSNorm
// and the attention output gate; each stage of the chunked rule alone (chunk_prepare, the chunk_state
// forms, chunk_out) against cpu::gated_delta_rule_chunked's intermediates. Outputs start NaN-poisoned:
// every element must be written.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <array>
#include <cmath>
#include <random>

#include "cuda_test_util.h"
#include "cuda_test_util.h"
#include "gpu/device_info.h"
#include "ops/activation.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/gdn_kernels.h"
#include "ops/gated_delta_rule.h"
#include "ops/norm.h"
#include "test_util.h"

using namespace dflash;

using CudaGdn = test::GpuTest;

namespace {

template <typename T>
cuda::DeviceArray<T> poisoned(size_t n) {
  cuda::DeviceArray<T> d(n);
  DFLASH_CUDA_CHECK(cudaMemset(d.data(), 0xFF, n * sizeof(T)));  // all-ones bits: NaN in fp32 and bf16
  return d;
}

cuda::DeviceArray<float> device_f32(const std::vector<float>& v) {
  cuda::DeviceArray<float> d(v.size());
  DFLASH_CUDA_CHECK(cudaMemcpy(d.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

std::vector<float> host_f32(const cuda::DeviceArray<float>& d) {
  std::vector<float> h(d.size());
  DFLASH_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), h.size() * 4, cudaMemcpyDeviceToHost));
  return h;
}

/// Rows of `cols` values (bf16-representable) placed at column `offset` of rows of `stride` bf16 on the
/// device, the rest NaN: an input read in place from a wider GEMM output (in_proj's).
cuda::DeviceArray<cuda::bf16> bf16_in_rows(const std::vector<float>& v, int64_t cols, int64_t stride, int64_t offset) {
  const int64_t rows = int64_t(v.size()) / cols;
  std::vector<float> wide(size_t(rows * stride), NAN);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(v.begin() + r * cols, cols, wide.begin() + r * stride + offset);
  return test::to_device_bf16(wide, nullptr);
}

/// The recurrence's q, k, v from conv1d output rows [T, C] (q | k | v), as gdn_prepare makes them:
/// q = scale cpu::l2_norm (eps 1e-6), k = cpu::l2_norm, v copied (src/models/qwen3_5.cpp).
struct QkvReference {
  std::vector<float> q, k, v;
  QkvReference(const float* rows, int64_t T, int64_t C, int64_t Hk, int64_t dk, float scale) {
    for (int64_t t = 0; t < T; ++t) {
      const float* r = rows + t * C;
      std::vector<float> qt(r, r + Hk * dk), kt(r + Hk * dk, r + 2 * Hk * dk);
      cpu::l2_norm(qt.data(), Hk, dk);
      cpu::l2_norm(kt.data(), Hk, dk);
      for (float& x : qt) x *= scale;
      q.insert(q.end(), qt.begin(), qt.end());
      k.insert(k.end(), kt.begin(), kt.end());
      v.insert(v.end(), r + 2 * Hk * dk, r + C);
    }
  }
};

std::vector<int64_t> cu_of(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}
}  // namespace

TEST_F(CudaGdn, Conv1dSiluMatchesTheReference) {
  std::mt19937_64 rng(1);
  // (C, row stride): one channel per thread (C odd; a row stride of 2 mod 4, as an odd Hv makes), four
  // (C and the stride multiples of 4; 2052 channels: three blocks, the last partial).
  for (auto [C, stride] : {std::pair<int64_t, int64_t>{37, 41}, {40, 42}, {40, 44}, {2052, 2056}}) {
    for (int K : {4, 2, 1, 8}) {
      const std::vector<int64_t> cu = cu_of({1, 63, 64, 3, 65, 127});
      const int64_t T = cu.back();
      Tensor x({T, C}), w({C, int64_t(K)});
      x.data = test::rand_bf16_values(size_t(T * C), rng);
      w.data = test::rand_bf16_values(size_t(C * K), rng, 0.5f);
      const Tensor want = cpu::causal_conv1d_silu(x, w, cu);
      auto dx = bf16_in_rows(x.data, C, stride, 0);  // the q | k | v columns of in_proj's rows, read in place
      auto dw = device_f32(w.data);
      auto y = poisoned<float>(size_t(T * C));
      auto starts = cuda::upload(cuda::sequence_starts(cu), nullptr);
      cuda::causal_conv1d_silu(dx.data(), stride, dw.data(), starts.data(), T, C, K, y.data(), nullptr);
      const std::vector<float> got = host_f32(y);
      ASSERT_TRUE(test::all_finite(got)) << "C " << C << " stride " << stride << " K " << K;
      EXPECT_LE(test::rel_l2(got, want.data), test::kTolF32) << "C " << C << " stride " << stride << " K " << K;
    }
  }
  EXPECT_THROW(cuda::causal_conv1d_silu(nullptr, 1, nullptr, nullptr, 1, 1, 9, nullptr, nullptr),
               std::invalid_argument);  // kernel size 9
  EXPECT_THROW(cuda::causal_conv1d_silu(nullptr, 3, nullptr, nullptr, 1, 4, 4, nullptr, nullptr),
               std::invalid_argument);  // row stride 3 < 4 channels
}

TEST_F(CudaGdn, Conv1dSiluWithQueryKeyNormMatchesTheReference) {
  std::mt19937_64 rng(4);
  // (Hk, dk, Hv, dv, row stride past C): normalized in the conv kernel with heads of 32 lanes (the
  // real dims; one query head, the last warp's lanes past C idle), 2 lanes (the fixtures' dk 8), 1
  // lane; by the second kernel for dk 12 (not a power of two) and for a row stride of 2 mod 4 (one
  // channel per thread).
  struct Case {
    int64_t Hk, dk, Hv, dv, pad;
  };
  for (const Case& cs : {Case{16, 128, 48, 128, 6240}, Case{1, 128, 3, 36, 8}, Case{2, 8, 4, 12, 4},
                         Case{3, 4, 2, 8, 0}, Case{2, 12, 3, 16, 4}, Case{2, 16, 3, 12, 2}}) {
    const std::vector<int64_t> cu = cu_of({1, 63, 64, 3, 65, 127});
    const int64_t T = cu.back(), C = 2 * cs.Hk * cs.dk + cs.Hv * cs.dv, stride = C + cs.pad, K = 4, qc = cs.Hk * cs.dk;
    const float scale = 1.f / std::sqrt(float(cs.dk));
    Tensor x({T, C}), w({C, K});
    x.data = test::rand_bf16_values(size_t(T * C), rng);
    w.data = test::rand_bf16_values(size_t(C * K), rng, 0.5f);
    const Tensor conv = cpu::causal_conv1d_silu(x, w, cu);
    const QkvReference want(conv.ptr(), T, C, cs.Hk, cs.dk, scale);
    std::vector<float> got_v;
    auto dx = bf16_in_rows(x.data, C, stride, 0);
    auto dw = device_f32(w.data);
    auto y = poisoned<float>(size_t(T * C)), q = poisoned<float>(size_t(T * qc)), k = poisoned<float>(size_t(T * qc));
    auto starts = cuda::upload(cuda::sequence_starts(cu), nullptr);
    const cuda::ConvQkNorm qk{int(cs.Hk), int(cs.dk), scale, q.data(), k.data()};
    cuda::causal_conv1d_silu(dx.data(), stride, dw.data(), starts.data(), T, C, int(K), y.data(), nullptr, &qk);
    const std::vector<float> all = host_f32(y);
    for (int64_t t = 0; t < T; ++t) got_v.insert(got_v.end(), all.begin() + t * C + 2 * qc, all.begin() + (t + 1) * C);
    const std::string what =
        "Hk " + std::to_string(cs.Hk) + " dk " + std::to_string(cs.dk) + " pad " + std::to_string(cs.pad);
    const std::vector<float> gq = host_f32(q), gk = host_f32(k);
    ASSERT_TRUE(test::all_finite(gq) && test::all_finite(gk) && test::all_finite(got_v)) << what;
    EXPECT_LE(test::rel_l2(gq, want.q), test::kTolF32) << what;
    EXPECT_LE(test::rel_l2(gk, want.k), test::kTolF32) << what;
    EXPECT_LE(test::rel_l2(got_v, want.v), test::kTolF32) << what;
  }
  float* p = nullptr;
  const cuda::ConvQkNorm wide{3, 8, 1.f, p, p};
  EXPECT_THROW(cuda::causal_conv1d_silu(nullptr, 40, nullptr, nullptr, 1, 40, 4, nullptr, nullptr, &wide),
               std::invalid_argument);  // 2 Hk dk = 48 > 40 channels (and no q / k)
}

TEST_F(CudaGdn, PrepareMatchesTheReference) {
  std::mt19937_64 rng(2);
  for (auto [Hk, Hv, dk, dv] : {std::array<int64_t, 4>{2, 6, 40, 24}, std::array<int64_t, 4>{16, 48, 128, 128}}) {
    const int64_t T = 70, C = 2 * Hk * dk + Hv * dv;
    const float scale = 1.f / std::sqrt(float(dk));
    const std::vector<float> qkv = test::rand_bf16_values(size_t(T * C), rng);
    const std::vector<float> b = test::rand_bf16_values(size_t(T * Hv), rng, 2.f), a = test::rand_bf16_values(size_t(T * Hv), rng, 4.f);
    const std::vector<float> A_log = test::rand_bf16_values(size_t(Hv), rng), dt_bias = test::rand_bf16_values(size_t(Hv), rng);
    auto d_qkv = device_f32(qkv);
    // b and a read in place from in_proj's bf16 rows: [.. | b | a], here 3 columns before b.
    std::vector<float> ba;
    for (int64_t t = 0; t < T; ++t) {
      ba.insert(ba.end(), b.begin() + t * Hv, b.begin() + (t + 1) * Hv);
      ba.insert(ba.end(), a.begin() + t * Hv, a.begin() + (t + 1) * Hv);
    }
    const int64_t ba_stride = 2 * Hv + 3;
    auto d_ba = bf16_in_rows(ba, 2 * Hv, ba_stride, 3);
    const cuda::bf16 *d_b = d_ba.data() + 3, *d_a = d_b + Hv;
    auto d_A = device_f32(A_log), d_dt = device_f32(dt_bias);
    auto q = poisoned<float>(size_t(T * Hk * dk)), k = poisoned<float>(size_t(T * Hk * dk)), v = poisoned<float>(size_t(T * Hv * dv));
    cuda::DeviceArray<float> g(size_t(T * Hv)), beta(size_t(T * Hv));
    cuda::gdn_prepare(d_qkv.data(), d_b, d_a, ba_stride, d_A.data(), d_dt.data(), T, int(Hk), int(Hv), int(dk),
                      int(dv), scale, q.data(), k.data(), v.data(), g.data(), beta.data(), nullptr);
    // Reference: QkvReference and the gates' formulas of gated_deltanet_forward (src/models/qwen3_5.cpp).
    const QkvReference want(qkv.data(), T, C, Hk, dk, scale);
    std::vector<float> wg, wb;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < Hv; ++h) {
        const size_t i = size_t(t * Hv + h);
        wb.push_back(cpu::sigmoid(b[i]));
        wg.push_back(-std::exp(A_log[size_t(h)]) * cpu::softplus(a[i] + dt_bias[size_t(h)]));
      }
    }
    EXPECT_LE(test::rel_l2(host_f32(q), want.q), test::kTolF32);
    EXPECT_LE(test::rel_l2(host_f32(k), want.k), test::kTolF32);
    EXPECT_EQ(host_f32(v), want.v);  // a copy
    EXPECT_LE(test::rel_l2(host_f32(g), wg), test::kTolF32);
    EXPECT_LE(test::rel_l2(host_f32(beta), wb), test::kTolF32);
    // Without v (the chunked rule reads it in place): the same q, k, g, beta.
    auto q2 = poisoned<float>(size_t(T * Hk * dk)), k2 = poisoned<float>(size_t(T * Hk * dk));
    cuda::gdn_prepare(d_qkv.data(), d_b, d_a, ba_stride, d_A.data(), d_dt.data(), T, int(Hk), int(Hv), int(dk),
                      int(dv), scale, q2.data(), k2.data(), nullptr, g.data(), beta.data(), nullptr);
    EXPECT_EQ(host_f32(q2), host_f32(q));
    EXPECT_EQ(host_f32(k2), host_f32(k));
    // Without q and k (the conv normalized them: ConvQkNorm): the same gates.
    cuda::DeviceArray<float> g3(size_t(T * Hv)), beta3(size_t(T * Hv));
    cuda::gdn_prepare(d_qkv.data(), d_b, d_a, ba_stride, d_A.data(), d_dt.data(), T, int(Hk), int(Hv), int(dk),
                      int(dv), scale, nullptr, nullptr, nullptr, g3.data(), beta3.data(), nullptr);
    EXPECT_EQ(host_f32(g3), host_f32(g));
    EXPECT_EQ(host_f32(beta3), host_f32(beta));
    EXPECT_THROW(cuda::gdn_prepare(d_qkv.data(), d_b, d_a, ba_stride, d_A.data(), d_dt.data(), T, int(Hk), int(Hv),
                                   int(dk), int(dv), scale, q2.data(), nullptr, nullptr, g.data(), beta.data(),
                                   nullptr),
                 std::invalid_argument);  // q without k
    EXPECT_THROW(cuda::gdn_prepare(d_qkv.data(), d_b, d_a, Hv - 1, d_A.data(), d_dt.data(), T, int(Hk), int(Hv),
                                   int(dk), int(dv), scale, q2.data(), k2.data(), nullptr, g.data(), beta.data(),
                                   nullptr),
                 std::invalid_argument);  // b / a rows overlapping
  }  // Hk 16, dk 128: each warp normalizes several heads
}

namespace {
// check_chunked's fused gated RMSNorm: z 16-byte aligned rows, at an odd offset, or 16-byte aligned
// with a row stride of 4 mod 8.
constexpr int kNormOff = 0, kNormStaged = 1, kNormDirect = 2, kNormStride4 = 3;

/// Random inputs of check_chunked and the stage tests, drawn from rng in this order: q, k bf16 values
/// l2-normalized (q times 1 / sqrt(dk)), v bf16 values, g = -20 u^4 (u uniform: mostly mild decays,
/// some down to -20; with `mild`, g = -0.05 u), beta = u. s0 [n, Hv, dk, dv] is zeros: the caller
/// draws it where the case has an initial state.
struct GdnDraw {
  Tensor q, k, v, g, beta, s0;
};
GdnDraw draw_gdn(int64_t T, int64_t n, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, std::mt19937_64& rng,
                 bool mild = false) {
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  GdnDraw d{Tensor({T, Hk, dk}), Tensor({T, Hk, dk}), Tensor({T, Hv, dv}), Tensor({T, Hv}), Tensor({T, Hv}),
            Tensor({n, Hv, dk, dv})};
  d.q.data = test::rand_bf16_values(d.q.data.size(), rng);
  d.k.data = test::rand_bf16_values(d.k.data.size(), rng);
  cpu::l2_norm(d.q.ptr(), T * Hk, dk);
  cpu::l2_norm(d.k.ptr(), T * Hk, dk);
  for (float& x : d.q.data) x /= std::sqrt(float(dk));
  d.v.data = test::rand_bf16_values(d.v.data.size(), rng);
  for (float& x : d.g.data) x = mild ? -0.05f * uni(rng) : -20.f * std::pow(uni(rng), 4.f);
  for (float& x : d.beta.data) x = uni(rng);
  return d;
}

/// One chunked-vs-recurrent comparison: random normalized q / k, v, g = -20 u^4 (u uniform:
/// mostly mild decays, some down to -20; with `mild`, g = -0.05 u, so that tokens a whole chunk apart
/// still interact), beta uniform in [0, 1], an optional random initial state.
/// With v_pad > 0 the values sit in rows of Hv dv + v_pad floats (v_row_stride; the rest NaN). With
/// `norm` the output goes through the fused gated RMSNorm (random w; random z read from wider rows,
/// kNormStaged: 16-byte aligned rows, which chunk_out stages in shared memory where dv % 8 == 0;
/// kNormDirect, kNormStride4: rows at an odd offset, or aligned with a stride of 4 mod 8, read by each
/// thread) and is checked against cpu::gated_rms_norm of the recurrence's output.
void check_chunked(const std::vector<int64_t>& lens, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, bool init,
                   uint64_t seed, bool recurrent = false, size_t shared_limit = 0, bool mild = false,
                   int64_t v_pad = 0, int norm = kNormOff) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  const std::vector<int64_t> cu = cu_of(lens);
  const int64_t T = cu.back(), n = int64_t(lens.size());
  auto [q, k, v, g, beta, s0] = draw_gdn(T, n, Hk, Hv, dk, dv, rng, mild);
  if (init)
    for (float& x : s0.data) x = 0.1f * (uni(rng) - 0.5f);
  Tensor want_state, want_tokens;
  const Tensor want = cpu::gated_delta_rule_recurrent(q, k, v, g, beta, 1.f, false, cu, init ? &s0 : nullptr, &want_state,
                                                      recurrent ? &want_tokens : nullptr);
  auto dq = device_f32(q.data), dk_ = device_f32(k.data), dv_ = device_f32(v.data);
  auto dg = device_f32(g.data), db = device_f32(beta.data), ds0 = device_f32(s0.data);
  auto fs = poisoned<float>(s0.data.size());
  auto o = poisoned<float>(size_t(T * Hv * dv));
  auto tokens = recurrent ? poisoned<float>(size_t(T * Hv * dk * dv)) : cuda::DeviceArray<float>();
  if (recurrent) {  // the state in place: s0 (zeros without init) in, the final state out
    cuda::gated_delta_rule_recurrent(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cu, int(Hk), int(Hv),
                                     int(dk), int(dv), ds0.data(), tokens.data(), o.data(), nullptr);
  } else if (norm != kNormOff) {  // z in wider rows, columns before and after, as in in_proj's output
    const int64_t z_off = norm == kNormDirect ? 3 : 8, z_stride = Hv * dv + 2 * z_off + (norm == kNormStride4 ? 4 : 0);
    Tensor z({T, Hv, dv}), w({dv});
    z.data = test::rand_bf16_values(z.data.size(), rng);
    w.data = test::rand_bf16_values(w.data.size(), rng);
    auto dz = bf16_in_rows(z.data, Hv * dv, z_stride, z_off);
    auto dw = device_f32(w.data);
    auto y = poisoned<cuda::bf16>(size_t(T * Hv * dv));
    const cuda::GatedNormOut out{dz.data() + z_off, z_stride, dw.data(), 1e-6f, y.data()};
    cuda::gated_delta_rule_chunked(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(),
                                   cuda::GdnChunkPlan(cu, nullptr), int(Hk), int(Hv), int(dk), int(dv),
                                   init ? ds0.data() : nullptr, fs.data(), nullptr, nullptr, shared_limit, 0, &out);
    Tensor want_y = want;
    cpu::gated_rms_norm(want_y, z, w, 1e-6);
    const std::vector<float> got_y = test::to_host_f32(y, nullptr);
    ASSERT_TRUE(test::all_finite(got_y)) << "gated RMSNorm output, T " << T << " dv " << dv;
    EXPECT_LE(test::rel_l2(got_y, want_y.data), test::kTolBf16OutGdn) << "gated RMSNorm output, T " << T << " dv " << dv;
    EXPECT_LE(test::rel_l2(host_f32(fs), want_state.data), test::kTolGdnChunked) << "final state, T " << T << " dv " << dv;
    const cuda::GatedNormOut narrow{dz.data() + z_off, Hv * dv - 1, dw.data(), 1e-6f, y.data()};
    const cuda::GatedNormOut odd_y{dz.data() + z_off, z_stride, dw.data(), 1e-6f, y.data() + 1};
    for (const cuda::GatedNormOut* bad : {&narrow, &odd_y})  // z rows overlapping; y not 4-byte aligned
      EXPECT_THROW(cuda::gated_delta_rule_chunked(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(),
                                                  cuda::GdnChunkPlan(cu, nullptr), int(Hk), int(Hv), int(dk), int(dv),
                                                  nullptr, nullptr, nullptr, nullptr, 0, 0, bad),
                   std::invalid_argument);
    return;
  } else if (v_pad) {
    const int64_t stride = Hv * dv + v_pad;
    std::vector<float> wide(size_t(T * stride), std::nanf(""));
    for (int64_t t = 0; t < T; ++t) std::copy_n(v.data.begin() + t * Hv * dv, Hv * dv, wide.begin() + t * stride);
    auto dw = device_f32(wide);
    cuda::gated_delta_rule_chunked(dq.data(), dk_.data(), dw.data(), dg.data(), db.data(), cuda::GdnChunkPlan(cu, nullptr),
                                   int(Hk), int(Hv), int(dk), int(dv), init ? ds0.data() : nullptr, fs.data(), o.data(),
                                   nullptr, shared_limit, stride);
  } else if (shared_limit) {
    cuda::gated_delta_rule_chunked(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cuda::GdnChunkPlan(cu, nullptr),
                                   int(Hk), int(Hv), int(dk), int(dv), init ? ds0.data() : nullptr, fs.data(), o.data(),
                                   nullptr, shared_limit);
  } else {
    cuda::gated_delta_rule_chunked(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cu, int(Hk), int(Hv),
                                   int(dk), int(dv), init ? ds0.data() : nullptr, fs.data(), o.data(), nullptr);
    if (init) {  // the state in place (as a cached decoding step runs it): the same output and state, bit for bit
      auto io = device_f32(s0.data);
      auto o2 = poisoned<float>(size_t(T * Hv * dv));
      cuda::gated_delta_rule_chunked(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cu, int(Hk), int(Hv),
                                     int(dk), int(dv), io.data(), io.data(), o2.data(), nullptr);
      EXPECT_EQ(host_f32(o2), host_f32(o)) << "output with the state in place";
      EXPECT_EQ(host_f32(io), host_f32(fs)) << "final state in place";
    }
  }
  const std::vector<float> got = host_f32(o), state = host_f32(recurrent ? ds0 : fs);
  if (recurrent) {
    EXPECT_LE(test::rel_l2(host_f32(tokens), want_tokens.data), test::kTolGdnChunked) << "every token's state";
  }
  std::string what = recurrent ? "recurrent, T" : "T";
  for (int64_t l : lens) what += " " + std::to_string(l);
  what += ", Hk " + std::to_string(Hk) + " Hv " + std::to_string(Hv) + " dk " + std::to_string(dk) + " dv " +
          std::to_string(dv) + (init ? ", initial state" : "");
  ASSERT_TRUE(test::all_finite(got)) << what;
  ASSERT_TRUE(test::all_finite(state)) << what;
  EXPECT_LE(test::rel_l2(got, want.data), test::kTolGdnChunked) << what;
  EXPECT_LE(test::rel_l2(state, want_state.data), test::kTolGdnChunked) << what << " (final state)";
}
}  // namespace

namespace {
/// gated_delta_rule_chunked from the projections (GdnProjections: conv1d, l2norm and gates inside
/// chunk_prepare where it fuses them) against the same layer through causal_conv1d_silu, gdn_prepare
/// and the chunked rule on their outputs (each checked against the CPU above): x rows of q | k | v | 5
/// more columns | b | a (rows padded to a multiple of 4 when `aligned`: the fused form needs it), an
/// initial state, o and the final state; with `norm`, the gated RMSNorm too. `fused`: whether
/// gdn_projections_fuse holds for these inputs; shared_limit as gated_delta_rule_chunked's.
void check_from_projections(const std::vector<int64_t>& lens, int Hk, int Hv, int dk, int dv, int K, bool norm,
                            bool aligned, bool fused, uint64_t seed, size_t shared_limit = 0) {
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> cu = cu_of(lens);
  const int64_t T = cu.back(), n = int64_t(lens.size()), C = 2 * int64_t(Hk) * dk + int64_t(Hv) * dv;
  const int64_t stride = aligned ? (C + 5 + 2 * Hv + 3) / 4 * 4 : C + 5 + 2 * Hv;  // ... | b | a ..
  const std::vector<float> x = test::rand_bf16_values(size_t(T * stride), rng), w = test::rand_bf16_values(size_t(C * K), rng);
  const std::vector<float> A_log = test::rand_bf16_values(size_t(Hv), rng, 0.5f), dt = test::rand_bf16_values(size_t(Hv), rng);
  std::vector<float> s0(size_t(n * Hv * dk * dv));
  for (float& v : s0) v = 0.05f * test::rand_bf16_values(1, rng)[0];
  const float scale = 1.f / std::sqrt(float(dk));
  auto dx = test::to_device_bf16(x, nullptr);
  auto dw = device_f32(w), dA = device_f32(A_log), ddt = device_f32(dt), ds0 = device_f32(s0);
  const cuda::bf16 *b = dx.data() + C + 5, *a = b + Hv;
  cuda::DeviceArray<int32_t> row_start(cuda::sequence_starts(cu), nullptr);
  const cuda::GdnChunkPlan plan(cu, nullptr);
  // z for the norm: the last Hv dv of q | k | v's columns, w_norm random.
  const std::vector<float> wn = test::rand_bf16_values(size_t(dv), rng);
  auto dwn = device_f32(wn);
  auto run = [&](bool from_projections) {
    auto o = poisoned<float>(size_t(T * Hv * dv));
    auto fs = poisoned<float>(s0.size());
    auto y = poisoned<cuda::bf16>(size_t(T * Hv * dv));
    const cuda::GatedNormOut out{dx.data() + C - Hv * dv, stride, dwn.data(), 1e-6f, y.data()};
    if (from_projections) {
      const cuda::GdnProjections from{dx.data(), stride, dw.data(), K, b, a, stride, dA.data(), ddt.data(), scale,
                                      row_start.data()};
      EXPECT_EQ(cuda::gdn_projections_fuse(from, dk), fused);
      cuda::gated_delta_rule_chunked(nullptr, nullptr, nullptr, nullptr, nullptr, plan, Hk, Hv, dk, dv, ds0.data(),
                                     fs.data(), norm ? nullptr : o.data(), nullptr, shared_limit, 0,
                                     norm ? &out : nullptr, &from);
    } else {
      cuda::DeviceArray<float> conv(size_t(T * C)), q(size_t(T * Hk * dk)), k(size_t(T * Hk * dk)), g(size_t(T * Hv)),
          beta(size_t(T * Hv));
      const cuda::ConvQkNorm qk{Hk, dk, scale, q.data(), k.data()};
      cuda::causal_conv1d_silu(dx.data(), stride, dw.data(), row_start.data(), T, C, K, conv.data(), nullptr, &qk);
      cuda::gdn_prepare(conv.data(), b, a, stride, dA.data(), ddt.data(), T, Hk, Hv, dk, dv, scale, nullptr, nullptr,
                        nullptr, g.data(), beta.data(), nullptr);
      cuda::gated_delta_rule_chunked(q.data(), k.data(), conv.data() + 2 * Hk * dk, g.data(), beta.data(), plan, Hk, Hv,
                                     dk, dv, ds0.data(), fs.data(), norm ? nullptr : o.data(), nullptr, shared_limit,
                                     C, norm ? &out : nullptr);
    }
    return std::array<std::vector<float>, 2>{norm ? test::to_host_f32(y, nullptr) : host_f32(o), host_f32(fs)};
  };
  const auto want = run(false), got = run(true);
  std::string what = "T";
  for (int64_t l : lens) what += " " + std::to_string(l);
  what += ", Hk " + std::to_string(Hk) + " Hv " + std::to_string(Hv) + " dk " + std::to_string(dk) + " dv " +
          std::to_string(dv) + " K " + std::to_string(K) + (norm ? ", gated RMSNorm" : "");
  ASSERT_TRUE(test::all_finite(got[0])) << what;
  ASSERT_TRUE(test::all_finite(got[1])) << what;
  // The same operations on the same values (fp32; only contractions into fma may differ), the norm's
  // output then rounded to bf16.
  EXPECT_LE(test::rel_l2(got[0], want[0]), norm ? test::kTolBf16OutGdn : 1e-6) << what;
  EXPECT_LE(test::rel_l2(got[1], want[1]), 1e-6) << what << " (final state)";
}
}  // namespace

TEST_F(CudaGdn, ChunkedFromTheProjectionsMatchesTheKernelsApart) {
  uint64_t seed = 60;
  // Fused into chunk_prepare (K 4, dk a power of two, rows a multiple of 4): chunks continuing their
  // sequence's conv window, sequences starting inside the chunk list, an empty one, short last chunks.
  check_from_projections({3, 64, 1, 0, 65, 130}, 2, 4, 32, 40, 4, false, true, true, ++seed);
  check_from_projections({300, 70}, 16, 48, 128, 128, 4, false, true, true, ++seed);  // the Qwen3.6 head shapes
  check_from_projections({200, 63}, 16, 48, 128, 128, 4, true, true, true, ++seed);   // with the gated RMSNorm
  check_from_projections({129}, 1, 2, 8, 12, 4, false, true, true, ++seed);           // a head of two lanes
  // Apart (conv1d and gdn_prepare first): rows of an odd length; dk not a power of two; a conv of 3;
  // the SIMT chunk_state (less shared memory), which reads fp32 keys.
  check_from_projections({3, 64, 130}, 2, 4, 32, 40, 4, false, false, false, ++seed);
  check_from_projections({3, 64, 130}, 2, 4, 24, 40, 4, false, true, false, ++seed);
  check_from_projections({70, 65}, 2, 4, 32, 40, 3, false, true, false, ++seed);
  check_from_projections({70, 65}, 2, 4, 32, 40, 4, false, true, true, ++seed, 48 * 1024);
  // No tokens, apart (conv of 3): the initial state passes through.
  {
    const std::vector<float> s0(size_t(2 * 4 * 32 * 40), 0.25f);
    auto d0 = device_f32(s0);
    auto fs = poisoned<float>(s0.size());
    auto x = poisoned<cuda::bf16>(8);
    auto w = poisoned<float>(8);
    cuda::DeviceArray<int32_t> starts(size_t(1));
    const cuda::GdnProjections none{x.data(), 300, w.data(), 3, x.data(), x.data(), 300, w.data(), w.data(), 1.f,
                                    starts.data()};
    cuda::gated_delta_rule_chunked(nullptr, nullptr, nullptr, nullptr, nullptr, cuda::GdnChunkPlan({0, 0, 0}, nullptr), 2, 4,
                                   32, 40, d0.data(), fs.data(), nullptr, nullptr, 0, 0, nullptr, &none);
    EXPECT_EQ(host_f32(fs), s0);
  }
  // Refused: rows narrower than q | k | v; a missing input (conv weights).
  auto x = poisoned<cuda::bf16>(64 * 300);
  auto w = poisoned<float>(288 * 4);
  cuda::DeviceArray<int32_t> starts(size_t(64));
  const cuda::GdnProjections narrow{x.data(), 100, w.data(), 4, x.data(), x.data(), 100, w.data(), w.data(), 1.f,
                                    starts.data()};
  const cuda::GdnProjections no_w{x.data(), 300, nullptr, 4, x.data(), x.data(), 300, w.data(), w.data(), 1.f,
                                  starts.data()};
  for (const cuda::GdnProjections* bad : {&narrow, &no_w})
    EXPECT_THROW(cuda::gated_delta_rule_chunked(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                cuda::GdnChunkPlan({0, 64}, nullptr), 2, 4, 32, 40, nullptr, nullptr,
                                                nullptr, nullptr, 0, 0, nullptr, bad),
                 std::invalid_argument);
}

TEST_F(CudaGdn, NoTokensPassTheInitialStateThrough) {
  const int Hv = 2, dk = 8, dv = 12;
  std::vector<float> s0(size_t(2 * Hv * dk * dv));
  for (size_t i = 0; i < s0.size(); ++i) s0[i] = float(i) * 0.01f;
  auto d0 = device_f32(s0);
  auto fs = poisoned<float>(s0.size());
  cuda::gated_delta_rule_chunked(nullptr, nullptr, nullptr, nullptr, nullptr, {0, 0, 0}, 1, Hv, dk, dv, d0.data(),
                                 fs.data(), nullptr, nullptr);
  EXPECT_EQ(host_f32(fs), s0);
}

TEST_F(CudaGdn, ChunkedMatchesTheRecurrence) {
  uint64_t seed = 10;
  for (int64_t T : {1, 63, 64, 65, 127}) check_chunked({T}, 2, 6, 32, 48, true, ++seed);
  check_chunked({3, 64, 1, 65, 130, 0, 7}, 2, 4, 24, 40, true, ++seed);  // packed, one empty sequence
  // Mild decays: every 16 x 16 tile of T = (I + A)^-1, far from the diagonal too, matters.
  check_chunked({64, 200}, 1, 3, 128, 128, true, ++seed, false, 0, true);
  check_chunked({130}, 2, 4, 32, 48, false, ++seed, false, 0, true);
  check_chunked({100, 37}, 1, 1, 8, 12, false, ++seed);                   // tiny heads, zero state
  check_chunked({4097}, 1, 2, 128, 128, true, ++seed);                    // the real head dims, long
  check_chunked({70, 5}, 2, 2, 64, 32, true, ++seed);                     // dk > dv
  check_chunked({130}, 1, 3, 32, 96, false, ++seed);                      // a second, partial block of 64 value columns
  check_chunked({50, 9}, 1, 1, 12, 4, true, ++seed);                      // head dims not multiples of 8
  check_chunked({33}, 2, 4, 4, 20, true, ++seed);
  check_chunked({130}, 1, 2, 32, 100, true, ++seed);  // dv > 64, not a multiple of 16: a partial second column block
  check_chunked({70, 3}, 1, 2, 48, 12, true, ++seed);  // dk >= 32 with a narrow dv
  check_chunked({65}, 1, 34, 8, 8, true, ++seed);      // Hv / Hk > 32: chunk_prepare's gate-summing warp wraps
  // Enough sequences x heads that chunk_state takes 64 value columns per block (more blocks than SMs
  // at 32), the second block of each head partial.
  check_chunked(std::vector<int64_t>(24, 70), 2, 8, 32, 96, true, ++seed);
  // The values read in place from wider rows (the conv output: q | k | v), as the target does.
  check_chunked({3, 64, 130}, 2, 4, 24, 40, true, ++seed, false, 0, false, 4 * 24 + 12);
  check_chunked({300}, 16, 48, 128, 128, true, ++seed, false, 0, false, 2 * 16 * 128);
}

TEST_F(CudaGdn, ChunkedWithTheGatedNormMatchesTheReference) {
  uint64_t seed = 40;
  for (int norm : {kNormStaged, kNormDirect}) {
    // One pass of columns; an empty sequence.
    check_chunked({3, 64, 1, 0, 65, 130}, 2, 4, 24, 40, true, ++seed, false, 0, false, 0, norm);
    check_chunked({200, 63}, 16, 48, 128, 128, true, ++seed, false, 0, false, 0, norm);       // the real head dims
    check_chunked({130}, 1, 2, 32, 104, false, ++seed, false, 0, true, 0, norm);  // a partial second pass, mild decays
    check_chunked({70}, 1, 3, 8, 72, true, ++seed, false, 0, false, 0, norm);     // a second pass of 8 columns, tiny dk
  }
  // Each staging condition alone: dv % 8 != 0 (z aligned), a z row stride of 4 mod 8.
  check_chunked({70}, 1, 2, 8, 68, true, ++seed, false, 0, false, 0, kNormStaged);
  check_chunked({70, 9}, 1, 2, 32, 64, true, ++seed, false, 0, false, 0, kNormStride4);
  // The SIMT chunk_state (its zeroed padding columns of H and U enter the row sums; dv 68 pads to 72).
  check_chunked({3, 64, 130}, 2, 4, 24, 68, true, ++seed, false, 48 * 1024, false, 0, kNormDirect);
  EXPECT_THROW(cuda::gated_delta_rule_chunked(nullptr, nullptr, nullptr, nullptr, nullptr, {0, 1}, 2, 3, 32, 32, nullptr,
                                              nullptr, nullptr, nullptr),
               std::invalid_argument);  // Hv % Hk != 0
  EXPECT_THROW(cuda::gated_delta_rule_chunked(nullptr, nullptr, nullptr, nullptr, nullptr, {0, 1}, 1, 1, 32, 10, nullptr,
                                              nullptr, nullptr, nullptr),
               std::invalid_argument);  // dv not a multiple of 4
}

// Less shared memory per block than the tensor-core chunk_state needs (A100: 163 KB, against ~177 KB
// at dk 128 and 32 state columns; 48 KB against ~66 KB at dk 24) takes the SIMT chunk_state: the same
// checks.
TEST_F(CudaGdn, ChunkedWithLessSharedMemoryMatchesTheRecurrence) {
  uint64_t seed = 30;
  check_chunked({4097}, 1, 2, 128, 128, true, ++seed, false, 163 * 1024);
  check_chunked({3, 64, 1, 65, 130, 0, 7}, 2, 4, 24, 40, true, ++seed, false, 48 * 1024);
  // 64 state columns do not fit in 200 KB at dk 128 (~209 KB) but 32 do (~177 KB): the tensor-core
  // kernel with 32, though its 384 blocks overfill one wave.
  check_chunked(std::vector<int64_t>(48, 65), 1, 2, 128, 128, true, ++seed, false, 200 * 1024);
  EXPECT_THROW(check_chunked({70}, 1, 1, 128, 128, false, ++seed, false, 20 * 1024), std::runtime_error);
}

// Hopper's warpgroup-MMA chunk_state (64 state columns per block at padded key dim 128, where the
// blocks fill a wave): sequences ending at and around chunk edges, packed, long, one empty (its
// initial state passes through); padded keys (dk 120, 116) with partial second column blocks (dv
// 100, 68), no initial state and mild decays; with the gated RMSNorm; one sequence of 48 heads.
TEST_F(CudaGdn, ChunkStateOnWarpgroupMmasMatchesTheRecurrence) {
  if (!cuda::runs_sm90a()) GTEST_SKIP() << "no Hopper GPU running sm_90a code: the warpgroup-MMA chunk_state does not run here";
  uint64_t seed = 60;
  // Each case checks first that its shapes take the warpgroup-MMA kernel.
  auto on_wgmma = [&](const std::vector<int64_t>& lens, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, bool init,
                      bool mild = false, int norm = kNormOff) {
    ASSERT_EQ(cuda::gdn_chunk_state_kernel(int(lens.size()), int(Hv), int(dk), int(dv)), cuda::GdnChunkState::kWgmma);
    check_chunked(lens, Hk, Hv, dk, dv, init, ++seed, false, 0, mild, 0, norm);
  };
  on_wgmma({1, 63, 64, 0, 65, 127, 4097}, 2, 6, 128, 128, true);  // with an empty sequence
  on_wgmma({130, 70, 5}, 3, 12, 120, 100, false, true);
  on_wgmma({192, 128, 3}, 2, 16, 116, 68, true);                  // a second column block of 4 columns
  on_wgmma({200, 63}, 16, 48, 128, 128, true, false, kNormStaged);
  on_wgmma({130}, 16, 48, 128, 128, true);  // one sequence of Qwen3.6-27B's 48 value heads (bench target-forward's case)
}

namespace {
// The stages of the chunked rule one at a time (ops/cuda/gdn_kernels.h) against the intermediates of
// cpu::gated_delta_rule_chunked on the same inputs: each stage reads the CPU's intermediates (split
// on the host where it takes bf16 pairs) and its outputs start NaN-poisoned.

/// A Split on the device, n values per part.
struct DeviceSplit {
  cuda::DeviceArray<cuda::bf16> hi, lo;
  explicit DeviceSplit(size_t n) {
    if (n) hi = poisoned<cuda::bf16>(n), lo = poisoned<cuda::bf16>(n);
  }
  /// x as hi = bf16(x), lo = bf16(x - hi) (mma::split_bf16x2's rounding).
  explicit DeviceSplit(const std::vector<float>& x) {
    std::vector<float> h(x.size()), l(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      h[i] = bf16_to_f32(f32_to_bf16(x[i]));
      l[i] = bf16_to_f32(f32_to_bf16(x[i] - h[i]));
    }
    hi = test::to_device_bf16(h, nullptr), lo = test::to_device_bf16(l, nullptr);
  }
  cuda::detail::Split get() { return {hi.data(), lo.data()}; }
  /// hi + lo on the host.
  std::vector<float> joined() const {
    std::vector<float> h = test::to_host_f32(hi, nullptr);
    const std::vector<float> l = test::to_host_f32(lo, nullptr);
    for (size_t i = 0; i < h.size(); ++i) h[i] += l[i];
    return h;
  }
};

/// [outer, rows, cols] into [outer, prows, pcols] (prows >= rows, pcols >= cols), zeros around.
std::vector<float> pad(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t prows, int64_t pcols) {
  const int64_t outer = int64_t(x.size()) / (rows * cols);
  std::vector<float> y(size_t(outer * prows * pcols), 0.f);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(x.begin() + (o * rows + r) * cols, cols, y.begin() + (o * prows + r) * pcols);
  return y;
}
/// The other way: [outer, prows, pcols] cut to [outer, rows, cols].
std::vector<float> unpad(const std::vector<float>& y, int64_t rows, int64_t cols, int64_t prows, int64_t pcols) {
  const int64_t outer = int64_t(y.size()) / (prows * pcols);
  std::vector<float> x(size_t(outer * rows * cols));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(y.begin() + (o * prows + r) * pcols, cols, x.begin() + (o * rows + r) * cols);
  return x;
}

/// A case of the stage tests: inputs as check_chunked's (normalized q / k, g = -20 u^4, beta uniform,
/// an initial state) and the chunked reference's trace of them.
struct StageCase {
  std::vector<int64_t> lens, cu;
  int64_t Hk, Hv, dk, dv, T, dkp, dv8;
  Tensor q, k, v, g, beta, s0;
  cpu::GdnChunkedTrace ref;
  StageCase(std::vector<int64_t> lens_, int64_t Hk_, int64_t Hv_, int64_t dk_, int64_t dv_, uint64_t seed)
      : lens(std::move(lens_)), cu(cu_of(lens)), Hk(Hk_), Hv(Hv_), dk(dk_), dv(dv_), T(cu.back()),
        dkp(cuda::detail::state_rows(int(dk))), dv8(cuda::detail::value_cols(int(dv))) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> uni(0.f, 1.f);
    GdnDraw d = draw_gdn(T, int64_t(lens.size()), Hk, Hv, dk, dv, rng);
    q = std::move(d.q), k = std::move(d.k), v = std::move(d.v), g = std::move(d.g), beta = std::move(d.beta);
    s0 = std::move(d.s0);
    for (float& x : s0.data) x = 0.1f * (uni(rng) - 0.5f);
    ref = cpu::gated_delta_rule_chunked(q, k, v, g, beta, cu, &s0);
  }
  int64_t chunks() const { return ref.h.dim(0); }
  std::string what() const {
    std::string s = "T";
    for (int64_t l : lens) s += " " + std::to_string(l);
    return s + ", Hk " + std::to_string(Hk) + " Hv " + std::to_string(Hv) + " dk " + std::to_string(dk) + " dv " +
           std::to_string(dv);
  }
};

/// got (finite) within kTolGdnChunked of want, the chunked rule's bound against the CPU.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_TRUE(test::all_finite(got)) << what;
  EXPECT_LE(test::rel_l2(got, want), test::kTolGdnChunked) << what;
}

// Sequences ending at and around chunk edges, packed; GVA; the real head dims (the warpgroup-MMA
// chunk_state's), padded keys and values (dk 36 -> 48, dv 20 -> 24), dk > dv with a partial second
// block of state columns.
const std::vector<std::array<int64_t, 4>> kStageDims = {{2, 4, 128, 128}, {1, 3, 36, 20}, {2, 2, 64, 100}};
const std::vector<int64_t> kStageLens = {1, 63, 64, 65, 130};
}  // namespace

TEST_F(CudaGdn, ChunkPrepareMatchesTheChunkedReference) {
  uint64_t seed = 80;
  for (const auto& d : kStageDims) {
    const StageCase c(kStageLens, d[0], d[1], d[2], d[3], ++seed);
    const cuda::GdnChunkPlan plan(c.cu, nullptr);
    ASSERT_EQ(plan.count, c.chunks());
    auto dq = device_f32(c.q.data), dk = device_f32(c.k.data), dv = device_f32(c.v.data);
    auto dg = device_f32(c.g.data), db = device_f32(c.beta.data);
    for (bool simt : {true, false}) {  // w in fp32 (for the SIMT chunk_state), or w and k split
      const std::string what = c.what() + (simt ? ", w fp32" : ", w split");
      auto u = poisoned<float>(size_t(c.T * c.Hv * c.dv)), G = poisoned<float>(size_t(c.T * c.Hv));
      auto w = simt ? poisoned<float>(size_t(c.T * c.Hv * c.dk)) : cuda::DeviceArray<float>();
      DeviceSplit w_s(simt ? 0 : size_t(c.T * c.Hv * c.dkp)), k_s(simt ? 0 : size_t(c.T * c.Hk * c.dkp));
      DeviceSplit q_s(size_t(c.T * c.Hk * c.dkp)), P_s(size_t(c.chunks() * c.Hv * 64 * 64));
      cuda::detail::launch_chunk_prepare(0, dq.data(), dk.data(), dv.data(), dg.data(), db.data(), plan.chunks.data(),
                                         plan.count, int(c.Hk), int(c.Hv), int(c.dk), int(c.dv),
                                         simt ? w.data() : nullptr, w_s.get(), k_s.get(), q_s.get(), u.data(),
                                         P_s.get(), G.data(), 0, cuda::GdnProjections{}, nullptr, nullptr);
      DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
      expect_close(host_f32(G), c.ref.G.data, "G, " + what);
      expect_close(host_f32(u), c.ref.u.data, "u, " + what);
      expect_close(P_s.joined(), c.ref.P.data, "P, " + what);
      expect_close(unpad(q_s.joined(), 1, c.dk, 1, c.dkp), c.q.data, "q split, " + what);
      if (simt) {
        expect_close(host_f32(w), c.ref.w.data, "w, " + what);
      } else {
        expect_close(unpad(w_s.joined(), 1, c.dk, 1, c.dkp), c.ref.w.data, "w split, " + what);
        expect_close(unpad(k_s.joined(), 1, c.dk, 1, c.dkp), c.k.data, "k split, " + what);
      }
    }
  }
}

TEST_F(CudaGdn, ChunkStateFormsMatchTheChunkedReference) {
  uint64_t seed = 90;
  int wgmma_runs = 0;
  for (const auto& d : kStageDims) {
    const StageCase c(kStageLens, d[0], d[1], d[2], d[3], ++seed);
    const cuda::GdnChunkPlan plan(c.cu, nullptr);
    auto dk = device_f32(c.k.data), dw = device_f32(c.ref.w.data), du = device_f32(c.ref.u.data);
    auto dG = device_f32(c.ref.G.data), ds0 = device_f32(c.s0.data);
    DeviceSplit k_s(pad(c.k.data, 1, c.dk, 1, c.dkp)), w_s(pad(c.ref.w.data, 1, c.dk, 1, c.dkp));
    const size_t smem = cuda::detail::device_shared_limit();
    auto runs = [&](cuda::GdnChunkState form) {  // whether this GPU runs the form at these dims
      switch (form) {
        case cuda::GdnChunkState::kSimt: return cuda::detail::chunk_state_simt_smem(int(c.dk)) <= smem;
        case cuda::GdnChunkState::kMma32: return cuda::detail::chunk_state_mma_smem(int(c.dk), 32) <= smem;
        case cuda::GdnChunkState::kMma64: return cuda::detail::chunk_state_mma_smem(int(c.dk), 64) <= smem;
        case cuda::GdnChunkState::kWgmma:
          return cuda::runs_sm90a() && c.dkp == 128 && cuda::detail::chunk_state_wgmma_smem() <= smem;
      }
      return false;
    };
    ASSERT_TRUE(runs(cuda::GdnChunkState::kSimt)) << "the SIMT chunk_state fits every GPU the project runs on";
    for (auto form : {cuda::GdnChunkState::kSimt, cuda::GdnChunkState::kMma32, cuda::GdnChunkState::kMma64,
                      cuda::GdnChunkState::kWgmma}) {
      if (!runs(form)) continue;
      const int cols = form == cuda::GdnChunkState::kMma32 ? 32 : 64;
      const std::string what = c.what() + ", form " + std::to_string(int(form));
      auto fs = poisoned<float>(c.s0.data.size());
      DeviceSplit H_s(size_t(c.chunks() * c.Hv * c.dkp * c.dv8)), U_s(size_t(c.T * c.Hv * c.dv8));
      cuda::detail::ChunkStateArgs a;
      a.k = dk.data(), a.w = dw.data(), a.k_s = k_s.get(), a.w_s = w_s.get(), a.u = du.data(), a.G = dG.data();
      a.chunks = plan.chunks.data(), a.first = plan.first.data(), a.nseq = plan.nseq;
      a.Hk = int(c.Hk), a.Hv = int(c.Hv), a.dk = int(c.dk), a.dv = int(c.dv);
      a.init = ds0.data(), a.final_state = fs.data(), a.H_s = H_s.get(), a.U_s = U_s.get();
      if (form == cuda::GdnChunkState::kSimt)
        cuda::detail::launch_chunk_state_simt(a, nullptr);
      else if (form == cuda::GdnChunkState::kWgmma)
        cuda::detail::launch_chunk_state_wgmma(a, false, nullptr), ++wgmma_runs;
      else
        cuda::detail::launch_chunk_state_mma(cols, a, false, nullptr);
      DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
      expect_close(unpad(H_s.joined(), c.dk, c.dv, c.dkp, c.dv8), c.ref.h.data, "state before each chunk, " + what);
      expect_close(unpad(U_s.joined(), 1, c.dv, 1, c.dv8), c.ref.v_new.data, "U, " + what);
      expect_close(host_f32(fs), c.ref.final_state.data, "final state, " + what);
    }
  }
  if (cuda::runs_sm90a()) {
    EXPECT_GT(wgmma_runs, 0) << "the warpgroup-MMA chunk_state ran on no case";
  }
}

TEST_F(CudaGdn, ChunkOutMatchesTheChunkedReference) {
  uint64_t seed = 100;
  for (const auto& d : kStageDims) {
    const StageCase c(kStageLens, d[0], d[1], d[2], d[3], ++seed);
    const cuda::GdnChunkPlan plan(c.cu, nullptr);
    DeviceSplit q_s(pad(c.q.data, 1, c.dk, 1, c.dkp)), P_s(c.ref.P.data);
    DeviceSplit H_s(pad(c.ref.h.data, c.dk, c.dv, c.dkp, c.dv8)), U_s(pad(c.ref.v_new.data, 1, c.dv, 1, c.dv8));
    auto dG = device_f32(c.ref.G.data);
    auto o = poisoned<float>(size_t(c.T * c.Hv * c.dv));
    cuda::detail::launch_chunk_out(nullptr, q_s.get(), H_s.get(), U_s.get(), P_s.get(), dG.data(), plan.chunks.data(),
                                   plan.count, int(c.Hk), int(c.Hv), int(c.dk), int(c.dv), o.data(), nullptr, 0,
                                   nullptr, 0, false, nullptr);
    DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
    expect_close(host_f32(o), c.ref.o.data, "o, " + c.what());
  }
}

// The token-by-token kernel of decoding / verification: outputs, final state and every token's state.
TEST_F(CudaGdn, RecurrentMatchesTheReference) {
  uint64_t seed = 40;
  check_chunked({1}, 2, 6, 32, 48, true, ++seed, true);
  check_chunked({5, 0, 16, 1}, 2, 4, 24, 40, true, ++seed, true);  // packed, an idle sequence, partial column block
  check_chunked({17}, 1, 2, 128, 128, true, ++seed, true);         // the real head dims
  check_chunked({9, 3}, 2, 2, 64, 12, false, ++seed, true);        // dk > dv, zero state
  EXPECT_THROW(cuda::gated_delta_rule_recurrent(nullptr, nullptr, nullptr, nullptr, nullptr, {0, 1}, 1, 1, 256, 32,
                                                nullptr, nullptr, nullptr, nullptr),
               std::invalid_argument);  // dk above 128
}

// A rollback's replay (TargetGpu::truncate_cache): the first counts[s] tokens of each sequence from the
// same initial state give, bit for bit, the state the full run had after them; a count of 0 leaves
// the state alone; a count past a sequence's length is refused.
TEST_F(CudaGdn, RecurrentReplaysPrefixesExactly) {
  std::mt19937_64 rng(50);
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  const int Hk = 2, Hv = 4, dk = 32, dv = 40;
  const std::vector<int64_t> cu = cu_of({5, 16, 3, 9}), counts{2, 16, 0, 1};
  const int64_t T = cu.back(), n = 4, St = Hv * dk * dv;
  std::vector<float> q(size_t(T * Hk * dk)), k(q.size()), v(size_t(T * Hv * dv)), g(size_t(T * Hv)), beta(g.size()),
      s0(size_t(n * St));
  for (auto* x : {&q, &k, &v, &s0})
    for (float& e : *x) e = 0.2f * (uni(rng) - 0.5f);
  for (float& e : g) e = -0.3f * uni(rng);
  for (float& e : beta) e = uni(rng);
  auto dq = device_f32(q), dk_ = device_f32(k), dv_ = device_f32(v), dg = device_f32(g), db = device_f32(beta);
  auto full = device_f32(s0), part = device_f32(s0);
  auto tokens = poisoned<float>(size_t(T * St));
  auto o = poisoned<float>(size_t(T * Hv * dv));
  cuda::gated_delta_rule_recurrent(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cu, Hk, Hv, dk, dv,
                                   full.data(), tokens.data(), o.data(), nullptr);
  cuda::gated_delta_rule_recurrent(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cu, Hk, Hv, dk, dv,
                                   part.data(), nullptr, o.data(), nullptr, counts);
  const std::vector<float> all = host_f32(tokens), got = host_f32(part);
  for (int64_t s = 0; s < n; ++s) {
    const float* want = counts[size_t(s)] ? all.data() + (cu[size_t(s)] + counts[size_t(s)] - 1) * St : s0.data() + s * St;
    EXPECT_TRUE(std::equal(want, want + St, got.begin() + s * St)) << "sequence " << s;
  }
  EXPECT_THROW(cuda::gated_delta_rule_recurrent(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cu, Hk, Hv, dk,
                                                dv, part.data(), nullptr, o.data(), nullptr, {2, 17, 0, 1}),
               std::invalid_argument);
  EXPECT_THROW(cuda::gated_delta_rule_recurrent(dq.data(), dk_.data(), dv_.data(), dg.data(), db.data(), cu, Hk, Hv, dk,
                                                dv, part.data(), nullptr, o.data(), nullptr, {2, 1}),
               std::invalid_argument);
}

// The conv continuing cached windows, and the windows moved past the new tokens, against the CPU
// reference's window form (cpu::causal_conv1d_silu with a window, TargetCache's history).
TEST_F(CudaGdn, Conv1dWithWindowsMatchesTheReference) {
  std::mt19937_64 rng(3);
  const int64_t C = 20;
  for (int K : {4, 2, 8, 1}) {
    const std::vector<int64_t> lens{3, 0, 1, 12};
    const std::vector<int64_t> cu = cu_of(lens);
    const int64_t T = cu.back(), n = int64_t(lens.size()), K1 = K - 1;
    Tensor x({T, C}), w({C, int64_t(K)}), window({n, K1, C});
    x.data = test::rand_bf16_values(size_t(T * C), rng);
    w.data = test::rand_bf16_values(size_t(C * K), rng, 0.5f);
    window.data = test::rand_bf16_values(window.data.size(), rng);
    const Tensor want = cpu::causal_conv1d_silu(x, w, cu, &window);
    std::vector<int32_t> seq_of, cu32;
    for (size_t q = 0; q < lens.size(); ++q) {
      cu32.push_back(int32_t(cu[q]));
      seq_of.insert(seq_of.end(), size_t(lens[q]), int32_t(q));
    }
    cu32.push_back(int32_t(T));
    const int64_t stride = C + 3;  // read in place from wider bf16 rows
    auto dx = bf16_in_rows(x.data, C, stride, 0);
    auto dw = device_f32(w.data), dwin = device_f32(window.data);
    auto d_seq = cuda::upload(seq_of, nullptr), d_cu = cuda::upload(cu32, nullptr);
    auto y = poisoned<float>(size_t(T * C));
    auto hist = poisoned<float>(size_t((n * K1 + T) * C));
    cuda::causal_conv1d_silu_window(dx.data(), stride, dw.data(), dwin.data(), d_seq.data(), d_cu.data(), T, C, K,
                                    y.data(), nullptr);
    EXPECT_LE(test::rel_l2(host_f32(y), want.data), test::kTolF32) << "K " << K;
    cuda::conv_window_advance(dwin.data(), dx.data(), stride, d_cu.data(), int(n), T, C, K, hist.data(), nullptr);
    // Expected: per sequence, history = [old window ; its rows of x], the new window its last K-1 rows.
    std::vector<float> want_hist, want_win;
    for (int64_t q = 0; q < n; ++q) {
      std::vector<float> h(window.ptr() + q * K1 * C, window.ptr() + (q + 1) * K1 * C);
      h.insert(h.end(), x.ptr() + cu[size_t(q)] * C, x.ptr() + cu[size_t(q) + 1] * C);
      want_hist.insert(want_hist.end(), h.begin(), h.end());
      want_win.insert(want_win.end(), h.end() - K1 * C, h.end());
    }
    if (K > 1) {  // K 1: no window to keep (nothing written)
      EXPECT_EQ(host_f32(hist), want_hist) << "K " << K;
      EXPECT_EQ(host_f32(dwin), want_win) << "K " << K;
    }
  }
  EXPECT_THROW(
      cuda::causal_conv1d_silu_window(nullptr, 19, nullptr, nullptr, nullptr, nullptr, 1, 20, 4, nullptr, nullptr),
      std::invalid_argument);
  EXPECT_THROW(cuda::conv_window_advance(nullptr, nullptr, 19, nullptr, 1, 1, 20, 4, nullptr, nullptr),
               std::invalid_argument);
}

TEST_F(CudaGdn, GatedRmsNormAndOutputGateMatchTheReference) {
  std::mt19937_64 rng(3);
  const int64_t rows = 301;
  Tensor x, z;
  // The scalar kernel (n 48; n 128 with a z row stride of 2 mod 4, as an odd Hv makes), the float4
  // kernel's two widths.
  for (auto [n, pad] : {std::pair<int64_t, int64_t>{48, 12}, {128, 10}, {128, 12}, {256, 12}}) {
    x = Tensor({rows, n}), z = Tensor({rows, n});
    Tensor w({n});
    x.data = test::rand_bf16_values(x.data.size(), rng);
    z.data = test::rand_bf16_values(z.data.size(), rng);
    w.data = test::rand_bf16_values(w.data.size(), rng);
    auto dx = device_f32(x.data), dw = device_f32(w.data);
    // z's values are bf16 already (the same math as fp32), read in place from in_proj's wider rows:
    // 7 heads of n per token (rows = 43 tokens x 7 heads), 4 columns before them, pad - 4 after.
    const int64_t heads = 7, z_stride = heads * n + pad;
    auto dz = bf16_in_rows(z.data, heads * n, z_stride, 4);
    auto y = poisoned<cuda::bf16>(size_t(rows * n));
    cuda::gated_rms_norm(dx.data(), dz.data() + 4, heads, z_stride, dw.data(), y.data(), rows, n, 1e-6, nullptr);
    Tensor want = x;
    cpu::gated_rms_norm(want, z, w, 1e-6);
    const std::vector<float> got = test::to_host_f32(y, nullptr);
    ASSERT_TRUE(test::all_finite(got)) << "n " << n;
    EXPECT_LE(test::rel_l2(got, want.data), test::kTolBf16OutGdn) << "n " << n;
  }
  EXPECT_THROW(cuda::gated_rms_norm(nullptr, nullptr, 7, 7 * 128 - 1, nullptr, nullptr, 7, 128, 1e-6, nullptr),
               std::invalid_argument);
  const int64_t n = 256;
  // o *= sigmoid(gate) in bf16, an odd size (packed and scalar paths)
  auto ox = test::to_device_bf16(x.data, nullptr), oz = test::to_device_bf16(z.data, nullptr);
  cuda::mul_sigmoid(ox.data(), oz.data(), rows * n - 3, nullptr);
  std::vector<float> gated = x.data;
  for (size_t i = 0; i + 3 < gated.size(); ++i) gated[i] *= cpu::sigmoid(z.data[i]);
  EXPECT_LE(test::rel_l2(test::to_host_f32(ox, nullptr), gated), test::kTolBf16OutGdn);
}

#endif  // DFLASH_HAVE_CUDA
