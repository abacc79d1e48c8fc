// The mixture-of-experts kernels (src/ops/cuda/moe.h) against the CPU reference (moe_route,
// moe_forward in src/models/target.h): the router's picks and weights (ties, NaN, E not a multiple of
// 32, up to 1000 experts), the permutation, the grouped GEMM on ragged groups (empty experts, partial
// tiles, K and N not multiples of the tile), and the whole FFN with and without a shared expert.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <algorithm>
#include <random>

#include "cuda_test_util.h"
#include "models/target.h"
#include "ops/cuda/moe.h"
#include "cuda_test_util.h"
#include "test_util.h"

using namespace dflash;

using CudaMoe = test::GpuTest;

namespace {

struct Stream {
  cudaStream_t s;
  Stream() { DFLASH_CUDA_CHECK(cudaStreamCreate(&s)); }
  ~Stream() { cudaStreamDestroy(s); }
};

template <typename T>
std::vector<T> host(const cuda::DeviceArray<T>& d, cudaStream_t s) {
  return d.to_host(s);
}

/// A [rows, cols] tensor of bf16-representable values ~ N(0, scale^2).
Tensor rand_tensor(int64_t rows, int64_t cols, std::mt19937_64& rng, float scale) {
  Tensor t({rows, cols});
  t.data = test::rand_bf16_values(size_t(rows * cols), rng, scale);
  return t;
}

}  // namespace

TEST_F(CudaMoe, RouterPicksWhatTheReferencePicks) {
  Stream st;
  std::mt19937_64 rng(7);
  struct Case {
    int T, E, k;
    bool renorm;
  };
  for (const Case c : {Case{77, 6, 2, true}, Case{50, 40, 1, false}, Case{300, 256, 8, true}, Case{64, 1000, 32, false},
                       Case{9, 33, 33 - 1, true}}) {
    const int64_t ld = c.E + 3;  // a wider row (the shared gate's column sits past the experts)
    Tensor logits = rand_tensor(c.T, ld, rng, 2.f);
    // Ties: row 1 has all experts equal; row 2 repeats one value across every third expert.
    for (int e = 0; e < c.E; ++e) logits.row(1)[e] = 0.5f;
    for (int e = 0; e < c.E; e += 3) logits.row(2)[e] = 1.25f;
    Tensor experts({int64_t(c.T), int64_t(c.E)});
    for (int t = 0; t < c.T; ++t) std::copy_n(logits.row(t), c.E, experts.row(t));
    const MoeRouting ref = moe_route(experts, c.k, c.renorm);
    cuda::DeviceArray<float> d_logits(logits.data, st.s);
    cuda::DeviceArray<int32_t> ids(size_t(c.T * c.k)), counts(size_t(c.E));
    cuda::DeviceArray<float> w(size_t(c.T * c.k));
    counts.fill_bytes(0, st.s);
    cuda::moe_route(d_logits.data(), ld, c.T, c.E, c.k, c.renorm, ids.data(), w.data(), counts.data(), st.s);
    const auto g_ids = host(ids, st.s);
    const auto g_w = host(w, st.s);
    const auto g_counts = host(counts, st.s);
    std::vector<int32_t> want_counts(size_t(c.E), 0);
    for (size_t i = 0; i < ref.ids.size(); ++i) {
      ASSERT_EQ(g_ids[i], ref.ids[i]) << "E " << c.E << " k " << c.k << " pick " << i;
      EXPECT_NEAR(g_w[i], ref.weights[i], 2e-6 * std::max(1.f, ref.weights[i])) << "E " << c.E << " pick " << i;
      ++want_counts[size_t(ref.ids[i])];
    }
    EXPECT_EQ(g_counts, want_counts);
  }
  // A NaN logit: that token takes experts 0..k-1 with NaN weights; the others route normally.
  Tensor logits = rand_tensor(3, 16, rng, 1.f);
  logits.row(1)[5] = NAN;
  cuda::DeviceArray<float> d_logits(logits.data, st.s);
  cuda::DeviceArray<int32_t> ids(6), counts(16);
  cuda::DeviceArray<float> w(6);
  counts.fill_bytes(0, st.s);
  cuda::moe_route(d_logits.data(), 16, 3, 16, 2, true, ids.data(), w.data(), counts.data(), st.s);
  const auto g_ids = host(ids, st.s);
  const auto g_w = host(w, st.s);
  EXPECT_EQ(g_ids[2], 0);
  EXPECT_EQ(g_ids[3], 1);
  EXPECT_TRUE(std::isnan(g_w[2]) && std::isnan(g_w[3]));
  EXPECT_TRUE(std::isfinite(g_w[0]) && std::isfinite(g_w[5]));
  EXPECT_THROW(cuda::moe_route(d_logits.data(), 16, 3, 16, 33, true, ids.data(), w.data(), counts.data(), st.s),
               std::invalid_argument);
  EXPECT_THROW(cuda::moe_route(d_logits.data(), 16, 3, 2000, 2, true, ids.data(), w.data(), counts.data(), st.s),
               std::invalid_argument);
}

// The permutation and the grouped GEMM on ragged groups: experts with 0, 1, 63, 64, 65 and 130 rows,
// A rows gathered, N = 272 (3 column tiles, the last partial), K = 264 (9 steps of 32, the last partial).
TEST_F(CudaMoe, GroupedGemmMatchesTheReferenceOnRaggedGroups) {
  Stream st;
  std::mt19937_64 rng(11);
  const int E = 7, k = 2;
  const int64_t N = 272, K = 264;
  const std::vector<int> want = {64, 0, 1, 130, 63, 65, 1};  // picks per expert; sum = T * k
  std::vector<int32_t> ids;
  for (int e = 0; e < E; ++e) ids.insert(ids.end(), size_t(want[size_t(e)]), e);
  std::shuffle(ids.begin(), ids.end(), rng);
  const int64_t n = int64_t(ids.size()), T = n / k;
  ASSERT_EQ(n % k, 0);
  std::vector<int32_t> counts(want.begin(), want.end());
  const std::vector<float> a = test::rand_bf16_values(size_t(T * K), rng, 1.f);
  const std::vector<float> b = test::rand_bf16_values(size_t(E * N * K), rng, 0.1f);
  auto d_a = test::to_device_bf16(a, st.s);
  auto d_b = test::to_device_bf16(b, st.s);
  cuda::DeviceArray<int32_t> d_ids(ids, st.s), d_counts(counts, st.s);
  cuda::DeviceArray<int32_t> offsets{size_t(E) + 1}, tiles{size_t(E) + 1}, rows{size_t(n)}, slot_of{size_t(n)};
  cuda::moe_permute(d_ids.data(), d_counts.data(), T, E, k, offsets.data(), tiles.data(), rows.data(), slot_of.data(),
                    st.s);
  cuda::DeviceArray<float> c(size_t(n * N));
  c.fill_bytes(0xFF, st.s);  // NaN: every row must be written
  cuda::grouped_gemm(d_a.data(), rows.data(), d_b.data(), offsets.data(), tiles.data(), E, n, N, K, c.data(), st.s);
  const auto h_off = host(offsets, st.s), h_tiles = host(tiles, st.s), h_rows = host(rows, st.s),
             h_slot = host(slot_of, st.s);
  const auto h_c = host(c, st.s);
  int64_t off = 0, tl = 0;
  for (int e = 0; e <= E; ++e) {
    EXPECT_EQ(h_off[size_t(e)], off) << "offsets[" << e << "]";
    EXPECT_EQ(h_tiles[size_t(e)], tl) << "tile_start[" << e << "]";
    if (e < E) off += want[size_t(e)], tl += (want[size_t(e)] + 63) / 64;
  }
  std::vector<int> seen(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t slot = h_slot[size_t(i)], e = ids[size_t(i)];
    ASSERT_GE(slot, h_off[size_t(e)]);
    ASSERT_LT(slot, h_off[size_t(e) + 1]) << "pick " << i << " left its expert's rows";
    EXPECT_EQ(h_rows[size_t(slot)], i / k);
    ++seen[size_t(slot)];
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; })) << "slots are a permutation";
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = h_slot[size_t(i)], t = i / k, e = ids[size_t(i)];
    for (int64_t j = 0; j < N; ++j) {
      double ref = 0, mag = 0;
      for (int64_t q = 0; q < K; ++q) {
        const double p = double(a[size_t(t * K + q)]) * double(b[size_t((e * N + j) * K + q)]);
        ref += p, mag += std::fabs(p);
      }
      const double err = std::fabs(double(h_c[size_t(slot * N + j)]) - ref) / std::max(mag, 1e-30);
      worst = std::max(worst, err);
      ASSERT_LE(err, 1e-5) << "row " << i << " col " << j << " got " << h_c[size_t(slot * N + j)] << " want " << ref;
    }
  }
  std::printf("[gpu moe] grouped GEMM worst |err| / sum|a b| vs fp64: %.2e\n", worst);
  EXPECT_THROW(cuda::grouped_gemm(d_a.data(), rows.data(), d_b.data(), offsets.data(), tiles.data(), E, n, N, 12,
                                  c.data(), st.s),
               std::invalid_argument);
}

// The whole FFN against moe_forward on the same bf16 input and weights: the GPU rounds only the
// experts' SwiGLU output to bf16 (and accumulates in another order).
TEST_F(CudaMoe, FfnMatchesTheCpuReference) {
  Stream st;
  cuda::GemmContext gemm(st.s);
  std::mt19937_64 rng(5);
  for (const bool shared : {true, false}) {
    ModelSpec s;
    s.hidden_size = 64, s.num_experts = 12, s.num_experts_per_tok = 3, s.moe_intermediate_size = 40;
    s.shared_expert_intermediate_size = shared ? 48 : 0, s.norm_topk_prob = shared;
    const int64_t T = 150, D = s.hidden_size, E = s.num_experts, Im = s.moe_intermediate_size;
    const int64_t Is = s.shared_expert_intermediate_size;
    const float lin = 1.f / std::sqrt(float(D));
    MoeWeights w;
    w.router = rand_tensor(E, D, rng, 1.f);
    for (int64_t e = 0; e < E; ++e) {
      w.gate_up.push_back(rand_tensor(2 * Im, D, rng, lin));
      w.down.push_back(rand_tensor(D, Im, rng, 1.f / std::sqrt(float(Im))));
    }
    std::vector<float> router = w.router.data, gate_up, down;
    for (int64_t e = 0; e < E; ++e) {
      gate_up.insert(gate_up.end(), w.gate_up[size_t(e)].data.begin(), w.gate_up[size_t(e)].data.end());
      down.insert(down.end(), w.down[size_t(e)].data.begin(), w.down[size_t(e)].data.end());
    }
    if (shared) {
      w.shared.gate_proj = rand_tensor(Is, D, rng, lin), w.shared.up_proj = rand_tensor(Is, D, rng, lin);
      w.shared.down_proj = rand_tensor(D, Is, rng, 1.f / std::sqrt(float(Is)));
      w.shared_gate = rand_tensor(1, D, rng, lin);
      router.insert(router.end(), w.shared_gate.data.begin(), w.shared_gate.data.end());
    }
    const Tensor x = rand_tensor(T, D, rng, 1.f);
    const Tensor ref = moe_forward(s, w, x);
    auto d_router = test::to_device_bf16(router, st.s), d_gu = test::to_device_bf16(gate_up, st.s),
         d_down = test::to_device_bf16(down, st.s), d_x = test::to_device_bf16(x.data, st.s);
    cuda::DeviceArray<cuda::bf16> d_sgu, d_sd;
    if (shared) {  // the shared expert's gate_proj rows, then its up_proj rows
      std::vector<float> sgu = w.shared.gate_proj.data;
      sgu.insert(sgu.end(), w.shared.up_proj.data.begin(), w.shared.up_proj.data.end());
      d_sgu = test::to_device_bf16(sgu, st.s);
      d_sd = test::to_device_bf16(w.shared.down_proj.data, st.s);
    }
    std::vector<float> base(size_t(T * D));
    for (size_t i = 0; i < base.size(); ++i) base[i] = float(i % 7) - 3.f;  // x += moe(h): a non-zero residual
    cuda::DeviceArray<float> y(base, st.s);
    const cuda::MoeShape shape{T, D, int(E), int(s.num_experts_per_tok), Im, Is, s.norm_topk_prob};
    cuda::moe_ffn_forward(gemm, shape, {d_router.data(), d_gu.data(), d_down.data(), d_sgu.data(), d_sd.data()},
                          d_x.data(), y.data());
    std::vector<float> got = host(y, st.s);
    for (size_t i = 0; i < got.size(); ++i) got[i] -= base[i];
    const double e = test::rel_l2(got, ref.data);
    std::printf("[gpu moe] FFN (%s shared expert) rel L2 vs CPU fp32: %.2e\n", shared ? "with" : "no", e);
    EXPECT_LE(e, 1e-2);
  }
}

#endif
