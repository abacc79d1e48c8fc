// GPU block-sparse attention (src/ops/cuda/masked_attention.h) against the CPU reference
// (cpu::masked_attention_forward / _backward in float64 on the same bf16 inputs): DFlash masks
// (full and sliding layers, padding blocks, a late anchor), causal varlen batches, rows whose
// ranges overlap other rows' ranges, head_dim 64 / 128 (/ 256 forward). Outputs NaN-poisoned first.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <cmath>
#include <random>

#include "cuda_test_util.h"
#include "cuda_test_util.h"
#include "gpu/runtime.h"
#include "ops/cuda/masked_attention.h"
#include "ops/dflash_attention.h"
#include "tensor/dtype.h"
#include "test_util.h"

using namespace dflash;
using cuda::bf16;
using cuda::DeviceArray;

namespace {


struct Case {
  std::string name;
  int64_t Nq = 0, Nk = 0;
  int H = 0, Hkv = 0, D = 0;
  std::vector<cpu::KvRanges> ranges;
  bool backward = true;
};

BasicTensor<double> host(const std::vector<float>& v, std::vector<int64_t> shape) {
  BasicTensor<double> t(std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) t.data[i] = v[i];
  return t;
}

void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.name + " D " + std::to_string(c.D));
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  std::mt19937_64 rng(seed);
  const auto q = test::rand_bf16_values(size_t(c.Nq * c.H * c.D), rng), k = test::rand_bf16_values(size_t(c.Nk * c.Hkv * c.D), rng),
             v = test::rand_bf16_values(size_t(c.Nk * c.Hkv * c.D), rng), dout = test::rand_bf16_values(size_t(c.Nq * c.H * c.D), rng);
  const double scale = 1.0 / std::sqrt(double(c.D));
  const auto Q = host(q, {c.Nq, c.H, c.D}), K = host(k, {c.Nk, c.Hkv, c.D}), V = host(v, {c.Nk, c.Hkv, c.D}),
             DO = host(dout, {c.Nq, c.H, c.D});
  BasicTensor<double> lse_ref;
  const auto o_ref = cpu::masked_attention_forward(Q, K, V, c.ranges, scale, &lse_ref);

  auto dq_ = test::to_device_bf16(q, s), dk_ = test::to_device_bf16(k, s), dv_ = test::to_device_bf16(v, s), ddo = test::to_device_bf16(dout, s);
  DeviceArray<cuda::KvRange32> dr(cuda::to_kv_range32(c.ranges), s);
  DeviceArray<bf16> o(q.size());
  DeviceArray<float> lse(size_t(c.Nq * c.H));
  // The forward of each kernel family this GPU runs (mma.sync, and wgmma where kAuto picks it); the
  // backward below takes the kAuto forward's o and lse.
  auto forward = [&](cuda::AttentionKernel kernel, const char* what) {
    o.fill_bytes(0xFF, s);
    lse.fill_bytes(0xFF, s);
    cuda::masked_attention_forward(dq_.data(), dk_.data(), dv_.data(), dr.data(), c.Nq, c.Nk, c.H, c.Hkv, c.D,
                                   float(scale), o.data(), lse.data(), s, kernel);
    const auto o_gpu = test::to_host_f32(o, s);
    const auto lse_gpu = lse.to_host(s);
    ASSERT_TRUE(test::all_finite(o_gpu)) << what;
    const double eo = test::rel_l2(o_gpu, o_ref.data);
    EXPECT_LE(eo, test::kTolBf16Attention) << what;
    std::vector<double> lf_gpu, lf_ref;
    for (size_t i = 0; i < lse_gpu.size(); ++i) {
      if (std::isinf(lse_ref.data[i])) {
        EXPECT_TRUE(std::isinf(lse_gpu[i]) && lse_gpu[i] < 0) << what << ": row-head " << i << " sees nothing";
        continue;
      }
      lf_gpu.push_back(lse_gpu[i]);
      lf_ref.push_back(lse_ref.data[i]);
    }
    const double el = test::rel_l2(lf_gpu, lf_ref);
    EXPECT_LE(el, 1e-5) << what;
    std::printf("%s fwd: o %.2e lse %.2e", what, eo, el);
  };
  std::printf("[gpu attention] %-26s D %3d ", c.name.c_str(), c.D);
  if (cuda::masked_attention_uses_wgmma(c.D)) {
    forward(cuda::AttentionKernel::kMmaSync, "mma.sync");
    std::printf(" | ");
    forward(cuda::AttentionKernel::kAuto, "wgmma");
  } else {
    forward(cuda::AttentionKernel::kAuto, "mma.sync");
  }
  if (c.backward) {
    BasicTensor<double> dq_ref, dk_ref, dv_ref;
    cpu::masked_attention_backward(Q, K, V, o_ref, lse_ref, DO, c.ranges, scale, &dq_ref, &dk_ref, &dv_ref);
    DeviceArray<char> ws{size_t(  // (mma.sync's size serves both kernel families)
        cuda::masked_attention_backward_workspace_bytes(c.Nq, c.Nk, c.H, c.Hkv, c.D, cuda::AttentionKernel::kMmaSync))};
    auto backward = [&](cuda::AttentionKernel kernel, const char* what) {
      DeviceArray<bf16> gq(q.size()), gk(k.size()), gv(v.size());
      gq.fill_bytes(0xFF, s);
      gk.fill_bytes(0xFF, s);
      gv.fill_bytes(0xFF, s);
      cuda::masked_attention_backward(dq_.data(), dk_.data(), dv_.data(), o.data(), lse.data(), ddo.data(), dr.data(),
                                      c.Nq, c.Nk, c.H, c.Hkv, c.D, float(scale), gq.data(), gk.data(), gv.data(),
                                      ws.data(), s, kernel);
      const auto a = test::to_host_f32(gq, s), b = test::to_host_f32(gk, s), d = test::to_host_f32(gv, s);
      ASSERT_TRUE(test::all_finite(a) && test::all_finite(b) && test::all_finite(d)) << what;
      const double e1 = test::rel_l2(a, dq_ref.data), e2 = test::rel_l2(b, dk_ref.data), e3 = test::rel_l2(d, dv_ref.data);
      EXPECT_LE(e1, test::kTolBf16Attention) << what;
      EXPECT_LE(e2, test::kTolBf16Attention) << what;
      EXPECT_LE(e3, test::kTolBf16Attention) << what;
      std::printf(" | %s bwd: dq %.2e dk %.2e dv %.2e", what, e1, e2, e3);
    };
    if (cuda::masked_attention_uses_wgmma(c.D)) backward(cuda::AttentionKernel::kMmaSync, "mma.sync");
    backward(cuda::AttentionKernel::kAuto, cuda::masked_attention_uses_wgmma(c.D) ? "wgmma" : "mma.sync");
  }
  std::printf("\n");
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

Case dflash_case(const std::string& name, int64_t S, std::vector<int64_t> anchors, int64_t blocks, int64_t B,
                 int64_t window, int H, int Hkv, int D, bool causal = false) {
  Case c;
  c.name = name;
  c.Nq = blocks * B;
  c.Nk = S + c.Nq;
  c.H = H, c.Hkv = Hkv, c.D = D;
  c.ranges = cpu::dflash_kv_ranges(anchors, blocks, B, S, window, causal);
  return c;
}

}  // namespace

TEST(CudaMaskedAttention, DflashMasksFullSlidingAndPadding) {
  DFLASH_REQUIRE_GPU();
  for (int D : {64, 128}) {
    // anchor 35 of S = 37: its block's positions run past the context; block 4 is padding
    run_case(dflash_case("dflash full S37", 37, {2, 9, 15, 35}, 5, 4, 0, 4, 2, D), 10 + D);
    run_case(dflash_case("dflash sliding S37 W6", 37, {2, 9, 15, 35}, 5, 4, 6, 4, 2, D), 20 + D);
    run_case(dflash_case("dflash causal full S37", 37, {2, 9, 15, 35}, 5, 4, 0, 4, 2, D, true), 25 + D);
  }
  std::mt19937_64 rng(7);
  std::vector<int64_t> anchors;
  for (int64_t a = 5; a < 300 && anchors.size() < 38; a += 1 + int64_t(rng() % 12)) anchors.push_back(a);
  run_case(dflash_case("dflash full S300 B16", 300, anchors, 40, 16, 0, 8, 2, 128), 30);
  run_case(dflash_case("dflash sliding S300 W64", 300, anchors, 40, 16, 64, 8, 2, 128), 31);
  // head_dim 256 (forward only): 32-key tiles, so block ranges start and end inside tiles.
  Case d256 = dflash_case("dflash sliding S300 W40 D256", 300, anchors, 40, 16, 40, 4, 2, 256);
  d256.backward = false;
  run_case(d256, 32);
  // 70 blocks of 16 = 18 query tiles: the mma.sync dK / dV launch splits into parts (fp32 partials +
  // reduce); the wgmma one does not.
  anchors.clear();
  for (int64_t a = 3; a < 600 && anchors.size() < 70; a += 1 + int64_t(rng() % 14)) anchors.push_back(a);
  for (int D : {64, 128}) run_case(dflash_case("dflash full S600 split dkv", 600, anchors, 70, 16, 0, 4, 2, D), 40 + D);
  // 136 blocks = 34 query tiles: the keys of the last blocks are first reached past query tile 32
  // (the dK / dV work list's search goes on to its second group of 32 tiles).
  anchors.clear();
  for (int64_t a = 3; anchors.size() < 136; a += 7) anchors.push_back(a);
  run_case(dflash_case("dflash S1000 34 query tiles", 1000, anchors, 136, 16, 0, 2, 1, 128), 50);
}

TEST(CudaMaskedAttention, CausalVarlenAndOverlappingRows) {
  DFLASH_REQUIRE_GPU();
  const std::vector<int64_t> cu = {0, 70, 71, 200};
  for (int D : {64, 128, 256}) {
    Case c;
    c.name = "causal varlen 70/1/129";
    c.Nq = c.Nk = 200;
    c.H = 4, c.Hkv = 1, c.D = D;
    for (const auto& r : cuda::causal_ranges(cu)) c.ranges.push_back({r.ctx_begin, r.ctx_end, r.blk_begin, r.blk_end});
    c.backward = D != 256;
    run_case(c, 40 + D);
  }
  // head_dim 256 as the Qwen3.5 / 3.6 targets run it (forward only): query heads sharing a kv head
  // 6 to 1, sequences longer than a query tile (128 rows) and ending inside one.
  {
    Case c;
    c.name = "causal varlen 300/257 GQA6";
    c.Nq = c.Nk = 557;
    c.H = 6, c.Hkv = 1, c.D = 256;
    for (const auto& r : cuda::causal_ranges({0, 300, 557})) c.ranges.push_back({r.ctx_begin, r.ctx_end, r.blk_begin, r.blk_end});
    c.backward = false;
    run_case(c, 45);
  }
  // Row 0 sees [0, 100); row 1 sees [0, 10) and [50, 60): the ctx and blk unions overlap, and no key
  // may count twice for row 0. Rows 2.. see nothing.
  for (int D : {64, 128, 256}) {
    Case c;
    c.name = "overlapping unions";
    c.Nq = 5, c.Nk = 120, c.H = 2, c.Hkv = 2, c.D = D;
    c.ranges.resize(5);
    c.ranges[0] = {0, 100, 0, 0};
    c.ranges[1] = {0, 10, 50, 60};
    c.backward = D != 256;
    run_case(c, 50 + D);
  }
  // Query tiles in which no row sees a key (rows 64.. of 200: every kernel's tile sizes), and keys
  // that no query sees (the dK / dV of keys 150..: zero).
  for (int D : {64, 128, 256}) {
    Case c;
    c.name = "rows and keys unseen";
    c.Nq = 200, c.Nk = 260, c.H = 4, c.Hkv = 2, c.D = D;
    c.ranges.resize(200);
    for (int i = 0; i < 64; ++i) c.ranges[size_t(i)] = {0, 40 + i, 140, 150};
    c.backward = D != 256;
    run_case(c, 60 + D);
  }
}

TEST(CudaMaskedAttention, RefusesUnsupportedHeadDims) {
  DFLASH_REQUIRE_GPU();
  EXPECT_THROW(cuda::masked_attention_forward(nullptr, nullptr, nullptr, nullptr, 4, 4, 2, 2, 96, 1.f, nullptr,
                                              nullptr, nullptr),
               std::invalid_argument);
  EXPECT_THROW(cuda::masked_attention_forward(nullptr, nullptr, nullptr, nullptr, 4, 4, 3, 2, 64, 1.f, nullptr,
                                              nullptr, nullptr),
               std::invalid_argument);
}

TEST(CudaMaskedAttention, RefusesScalesThatAreNotPositive) {
  // (Checked on the host before any CUDA call: runs without a GPU.) The kernels take each row's
  // maximum of the unscaled scores, so only a positive scale is right; one that overflows once
  // multiplied by log2(e) is refused too.
  for (float scale : {0.f, -0.125f, NAN, INFINITY, 3e38f}) {
    EXPECT_THROW(cuda::masked_attention_forward(nullptr, nullptr, nullptr, nullptr, 4, 4, 2, 2, 64, scale, nullptr,
                                                nullptr, nullptr),
                 std::invalid_argument)
        << scale;
    EXPECT_THROW(cuda::masked_attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 4,
                                                 2, 2, 64, scale, nullptr, nullptr, nullptr, nullptr, nullptr),
                 std::invalid_argument)
        << scale;
  }
}

TEST(CudaMaskedAttention, BackwardWithoutKeysZeroesDq) {
  DFLASH_REQUIRE_GPU();
  // No key at all: every row sees nothing, so dq is 0 (written, not left as it was).
  const int64_t Nq = 70, H = 4, D = 64;
  cudaStream_t s = nullptr;
  DeviceArray<bf16> q(size_t(Nq * H * D)), o(size_t(Nq * H * D)), dout(size_t(Nq * H * D)), dq(size_t(Nq * H * D));
  DeviceArray<float> lse(size_t(Nq * H));
  dq.fill_bytes(0xFF, s);  // NaN bf16
  cuda::masked_attention_backward(q.data(), nullptr, nullptr, o.data(), lse.data(), dout.data(), nullptr, Nq, 0, int(H), 2,
                                  int(D), 0.125f, dq.data(), nullptr, nullptr, nullptr, s);
  for (float x : test::to_host_f32(dq, s)) ASSERT_EQ(x, 0.f);
}

#endif

