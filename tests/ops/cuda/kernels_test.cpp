// GPU kernels of the dense path against the CPU references (src/ops/cpu), on fresh random inputs of
// odd sizes, with NaN-poisoned outputs. Skipped, saying so, where no GPU is visible (CI); they run in
// scripts/gpu_check.sh on the GPU machine.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <cmath>
#include <cstdlib>
#include <random>
#include <thread>

#include "cuda_test_util.h"
#include "gpu/runtime.h"
#include "ops/activation.h"
#include "ops/cuda/adamw.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/norm.h"
#include "ops/cuda/rope.h"
#include "ops/norm.h"
#include "ops/optimizer.h"
#include "ops/rope.h"
#include "tensor/dtype.h"
#include "test_util.h"

using namespace dflash;
using cuda::bf16;
using cuda::DeviceArray;
using test::all_finite;
using test::rand_bf16_values;
using test::to_device_bf16;
using test::to_host_f32;

namespace {


struct Stream {
  cudaStream_t s{};
  Stream() { DFLASH_CUDA_CHECK(cudaStreamCreate(&s)); }
  ~Stream() { cudaStreamDestroy(s); }
};

/// Row-major reference of C = op(A) op(B) in double.
std::vector<double> ref_gemm(const cuda::GemmShape& g, const std::vector<float>& A, const std::vector<float>& B) {
  std::vector<double> C(size_t(g.M * g.N), 0.0);
  for (int64_t i = 0; i < g.M; ++i)
    for (int64_t j = 0; j < g.N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < g.K; ++k) {
        const double a = g.trans_a ? A[size_t(k * g.M + i)] : A[size_t(i * g.K + k)];
        const double b = g.trans_b ? B[size_t(j * g.K + k)] : B[size_t(k * g.N + j)];
        s += a * b;
      }
      C[size_t(i * g.N + j)] = s;
    }
  return C;
}

}  // namespace

TEST(CudaGemm, AllTransposesOddSizesAccumulateAndBf16Output) {
  DFLASH_REQUIRE_GPU();
  Stream st;
  cuda::GemmContext ctx(st.s);
  std::mt19937_64 rng(1);
  for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{37, 53, 29}, {1, 200, 64}, {256, 384, 512}}) {
    for (int t = 0; t < 4; ++t) {
      const cuda::GemmShape g{M, N, K, bool(t & 1), bool(t & 2)};
      const auto A = rand_bf16_values(size_t(M * K), rng), B = rand_bf16_values(size_t(K * N), rng);
      const auto C0 = rand_bf16_values(size_t(M * N), rng);  // for beta = 1 (fp32 values)
      auto dA = to_device_bf16(A, st.s), dB = to_device_bf16(B, st.s);
      DeviceArray<float> dC(C0, st.s);
      ctx.gemm(g, dA.data(), dB.data(), dC.data(), 1.f, 1.f);
      const auto ref = ref_gemm(g, A, B);
      std::vector<double> want(ref.size());
      for (size_t i = 0; i < ref.size(); ++i) want[i] = ref[i] + C0[i];
      const double e = test::rel_l2(dC.to_host(st.s), want);
      EXPECT_LE(e, test::kTolF32) << "M " << M << " N " << N << " K " << K << " trans " << t;
      DeviceArray<bf16> dCb{size_t(M * N)};
      dCb.fill_bytes(0xFF, st.s);  // NaN poison: every element must be written
      ctx.gemm(g, dA.data(), dB.data(), dCb.data());
      const auto got = to_host_f32(dCb, st.s);
      EXPECT_TRUE(all_finite(got));
      EXPECT_LE(test::rel_l2(got, ref), test::kTolBf16Out) << "bf16 out, trans " << t;
    }
  }
  EXPECT_GE(cuda::GemmContext::cached_algorithms(), 12u);
  EXPECT_THROW(ctx.gemm({0, 4, 4}, nullptr, nullptr, static_cast<float*>(nullptr)), std::invalid_argument);
}

/// Sets DFLASH_GEMM_TUNE for a test and restores it however the test ends.
struct TuneEnv {
  bool had;
  std::string was;
  TuneEnv() : had(std::getenv("DFLASH_GEMM_TUNE") != nullptr), was(had ? std::getenv("DFLASH_GEMM_TUNE") : "") {}
  ~TuneEnv() { had ? setenv("DFLASH_GEMM_TUNE", was.c_str(), 1) : unsetenv("DFLASH_GEMM_TUNE"); }
  void set(const char* v) { setenv("DFLASH_GEMM_TUNE", v, 1); }
};

TEST(CudaGemm, TuneModesFromTheEnvironment) {
  // (No GPU needed.) DFLASH_GEMM_TUNE: unset / empty auto, "1" on, "log" on and printed, "0" off.
  TuneEnv env;
  unsetenv("DFLASH_GEMM_TUNE");
  EXPECT_EQ(cuda::gemm_tune_mode(), cuda::GemmTune::kAuto);
  for (auto [v, want] : {std::pair<const char*, cuda::GemmTune>{"", cuda::GemmTune::kAuto}, {"1", cuda::GemmTune::kOn},
                         {"log", cuda::GemmTune::kLog}, {"0", cuda::GemmTune::kOff}}) {
    env.set(v);
    EXPECT_EQ(cuda::gemm_tune_mode(), want) << "'" << v << "'";
  }
  for (const char* bad : {"off", "true", "01", "LOG"}) {
    env.set(bad);
    EXPECT_THROW(cuda::gemm_tune_mode(), std::invalid_argument) << "'" << bad << "'";
  }
}

TEST(CudaGemm, TunedAndHeuristicChoicesComputeTheProductOnce) {
  // Tuning runs the candidates on the caller's operands: with beta = 1 it must leave C to the one
  // product that counts, and a shape's later calls reuse its choice (bitwise the same result).
  DFLASH_REQUIRE_GPU();
  TuneEnv env;
  Stream st;
  cuda::GemmContext plain(st.s), tuning(st.s, size_t(32) << 20, true);
  std::mt19937_64 rng(5);
  // A new row bucket per mode (512, 1024, 2048, 4096): each one's first call chooses.
  for (auto [mode, m] : {std::pair<const char*, int64_t>{"0", 300}, {"1", 600}, {"log", 1100}, {"", 2100}}) {
    env.set(mode);
    const cuda::GemmShape g{m, 256, 320, false, true};
    const auto A = rand_bf16_values(size_t(g.M * g.K), rng), B = rand_bf16_values(size_t(g.N * g.K), rng);
    const auto C0 = rand_bf16_values(size_t(g.M * g.N), rng);
    auto dA = to_device_bf16(A, st.s), dB = to_device_bf16(B, st.s);
    const auto ref = ref_gemm(g, A, B);
    std::vector<double> want(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) want[i] = ref[i] + C0[i];
    const size_t before = cuda::GemmContext::cached_algorithms();
    for (cuda::GemmContext* ctx : {&tuning, &plain}) {
      testing::internal::CaptureStderr();
      DeviceArray<float> dC(C0, st.s);
      ctx->gemm(g, dA.data(), dB.data(), dC.data(), 1.f, 1.f);
      const std::string printed = testing::internal::GetCapturedStderr();
      EXPECT_EQ(printed.find("dflash gemm tune") != std::string::npos, std::string(mode) == "log" && ctx == &tuning)
          << "'" << mode << "': " << printed;  // printed once, at the shape's first call
      const auto got = dC.to_host(st.s);
      EXPECT_LE(test::rel_l2(got, want), test::kTolF32) << "'" << mode << "'";
      DeviceArray<float> dC2(C0, st.s);
      ctx->gemm(g, dA.data(), dB.data(), dC2.data(), 1.f, 1.f);
      EXPECT_EQ(dC2.to_host(st.s), got) << "'" << mode << "'";
    }
    // Unset (kAuto): only the tune_by_default context tunes, so the two keep separate choices.
    EXPECT_EQ(cuda::GemmContext::cached_algorithms(), before + (*mode ? 1 : 2)) << "'" << mode << "'";
    DeviceArray<bf16> dCb{size_t(g.M * g.N)};
    dCb.fill_bytes(0xFF, st.s);  // NaN poison: every element written by the chosen (beta 0) algorithm
    tuning.gemm(g, dA.data(), dB.data(), dCb.data());
    const auto got = to_host_f32(dCb, st.s);
    EXPECT_TRUE(all_finite(got));
    EXPECT_LE(test::rel_l2(got, ref), test::kTolBf16Out) << "'" << mode << "'";
  }
}

TEST(CudaGemm, TunedChoiceServesEveryRowCountOfItsBucket) {
  // A packed forward's token count changes every batch: the first row count of a power-of-two bucket
  // is timed, the others take its choice (no timing, nothing printed) and still compute the product.
  DFLASH_REQUIRE_GPU();
  TuneEnv env;
  env.set("log");
  Stream st;
  cuda::GemmContext ctx(st.s);
  std::mt19937_64 rng(6);
  const int64_t N = 192, K = 272;
  const auto B = rand_bf16_values(size_t(N * K), rng);
  auto dB = to_device_bf16(B, st.s);
  // (Fewer than 512 rows are never tuned: 100 prints nothing either.)
  for (auto [M, prints] :
       {std::pair<int64_t, bool>{600, true}, {513, false}, {1000, false}, {1100, true}, {100, false}}) {
    const cuda::GemmShape g{M, N, K, false, true};
    const auto A = rand_bf16_values(size_t(M * K), rng);
    auto dA = to_device_bf16(A, st.s);
    DeviceArray<float> dC{size_t(M * N)};
    dC.fill_bytes(0xFF, st.s);
    testing::internal::CaptureStderr();
    ctx.gemm(g, dA.data(), dB.data(), dC.data());
    const std::string printed = testing::internal::GetCapturedStderr();
    EXPECT_EQ(printed.find("dflash gemm tune") != std::string::npos, prints) << "M " << M << ": " << printed;
    EXPECT_LE(test::rel_l2(dC.to_host(st.s), ref_gemm(g, A, B)), test::kTolF32) << "M " << M;
  }
}

TEST(CudaGemm, TunedChoiceRefusedForMisalignedOperandsFallsBack) {
  // A choice tuned on 16-byte aligned operands may be refused (NOT_SUPPORTED) for operands 2 bytes
  // off (TMA-based kernels need 16-byte addresses): the same shape, and another row count of its
  // bucket, must then run cuBLASLt's first candidate for them and still compute the product.
  DFLASH_REQUIRE_GPU();
  TuneEnv env;
  env.set("1");
  Stream st;
  cuda::GemmContext ctx(st.s);
  std::mt19937_64 rng(7);
  const int64_t N = 160, K = 288;
  const auto B = rand_bf16_values(size_t(N * K), rng);
  auto dB = to_device_bf16(B, st.s);
  for (auto [M, offset] : {std::pair<int64_t, int64_t>{640, 0}, {640, 1}, {700, 1}, {640, 0}}) {
    const cuda::GemmShape g{M, N, K, false, true};
    const auto A = rand_bf16_values(size_t(M * K), rng);
    std::vector<float> A_off(size_t(offset), 0.f);  // A starts `offset` elements into its buffer
    A_off.insert(A_off.end(), A.begin(), A.end());
    auto dA = to_device_bf16(A_off, st.s);
    DeviceArray<float> dC{size_t(M * N + offset)};
    dC.fill_bytes(0xFF, st.s);
    ctx.gemm(g, dA.data() + offset, dB.data(), dC.data() + offset);
    const auto all = dC.to_host(st.s);
    const std::vector<float> got(all.begin() + offset, all.end());
    EXPECT_TRUE(all_finite(got)) << "M " << M << " offset " << offset;
    EXPECT_LE(test::rel_l2(got, ref_gemm(g, A, B)), test::kTolF32) << "M " << M << " offset " << offset;
  }
}

TEST(CudaGemm, ManyThreadsOwnStreamsAtOnce) {
  // The PyTorch stack's torch.compile race is what users hit: here every thread has its own stream
  // and context and shares the algorithm cache.
  DFLASH_REQUIRE_GPU();
  std::vector<std::thread> th;
  std::vector<double> err(8, 1.0);
  for (int w = 0; w < 8; ++w)
    th.emplace_back([&, w] {
      Stream st;
      cuda::GemmContext ctx(st.s);
      std::mt19937_64 rng(100 + w);
      const cuda::GemmShape g{64 + 16 * w, 96, 128, false, true};
      const auto A = rand_bf16_values(size_t(g.M * g.K), rng), B = rand_bf16_values(size_t(g.N * g.K), rng);
      auto dA = to_device_bf16(A, st.s), dB = to_device_bf16(B, st.s);
      DeviceArray<float> dC{size_t(g.M * g.N)};
      for (int rep = 0; rep < 20; ++rep) ctx.gemm(g, dA.data(), dB.data(), dC.data());
      err[size_t(w)] = test::rel_l2(dC.to_host(st.s), ref_gemm(g, A, B));
    });
  for (auto& t : th) t.join();
  for (int w = 0; w < 8; ++w) EXPECT_LE(err[size_t(w)], test::kTolF32) << "thread " << w;
}

TEST(CudaRmsNorm, ForwardBackwardPlainAndZeroCentered) {
  DFLASH_REQUIRE_GPU();
  Stream st;
  std::mt19937_64 rng(2);
  // Row lengths for every kernel (norm.cu): vectorized block rows with 1, 2, 3 (a partial last
  // chunk) and 4 chunks per thread, vectorized warp rows of 1 and 2 chunks per lane (64: half the
  // lanes), and the scalar kernels (n not a multiple of 8 or 4, or 256 < n <= 1024).
  for (auto [rows, n] : {std::pair<int64_t, int64_t>{37, 128}, {300, 4096}, {5, 1000}, {64, 5120}, {9, 2056},
                         {4, 2048}, {3, 8192}, {11, 64}, {13, 256}, {3, 1030}, {7, 300}, {6, 90}}) {
    for (bool zc : {false, true}) {
      const auto x = rand_bf16_values(size_t(rows * n), rng, 2.f), dy = rand_bf16_values(size_t(rows * n), rng);
      const auto w = rand_bf16_values(size_t(n), rng, 0.3f);
      // CPU reference in double on the same inputs, gain g = w or 1 + w.
      BasicTensor<double> X({rows, n}), G({n}), DY({rows, n});
      for (size_t i = 0; i < x.size(); ++i) X.data[i] = x[i], DY.data[i] = dy[i];
      for (int64_t c = 0; c < n; ++c) G.data[size_t(c)] = (zc ? 1.0 : 0.0) + w[size_t(c)];
      BasicTensor<double> inv_ref, dx_ref, dw_ref;
      const auto y_ref = cpu::rms_norm_forward(X, G, 1e-6, &inv_ref);
      cpu::rms_norm_backward(X, G, inv_ref, DY, &dx_ref, &dw_ref);

      auto dX = to_device_bf16(x, st.s), dDY = to_device_bf16(dy, st.s);
      DeviceArray<float> dW(w, st.s), inv{size_t(rows)};
      DeviceArray<bf16> Y{size_t(rows * n)}, DX{size_t(rows * n)};
      Y.fill_bytes(0xFF, st.s);
      DX.fill_bytes(0xFF, st.s);
      cuda::rms_norm_forward(dX.data(), dW.data(), Y.data(), inv.data(), rows, n, 1e-6, zc, st.s);
      std::vector<float> dw0(size_t(n), 0.5f);  // dw accumulates
      DeviceArray<float> dWg(dw0, st.s);
      DeviceArray<float> ws{size_t(cuda::rms_norm_workspace_floats(rows, n))};
      cuda::rms_norm_backward(dX.data(), dW.data(), inv.data(), dDY.data(), DX.data(), dWg.data(), ws.data(), rows, n,
                              zc, st.s);
      const auto y = to_host_f32(Y, st.s), dx = to_host_f32(DX, st.s);
      auto dw = dWg.to_host(st.s);
      for (float& v : dw) v -= 0.5f;
      ASSERT_TRUE(all_finite(y) && all_finite(dx));
      EXPECT_LE(test::rel_l2(y, y_ref.data), test::kTolBf16Out) << rows << "x" << n << " zc " << zc;
      EXPECT_LE(test::rel_l2(inv.to_host(st.s), inv_ref.data), test::kTolF32);
      EXPECT_LE(test::rel_l2(dx, dx_ref.data), test::kTolBf16Out) << rows << "x" << n << " zc " << zc;
      EXPECT_LE(test::rel_l2(dw, dw_ref.data), test::kTolF32 * 10) << rows << "x" << n << " zc " << zc;
      // The fp32-input forward (a residual stream kept in fp32), and a bf16 input 8 bytes off 16-byte
      // alignment (the scalar kernels take over).
      DeviceArray<float> dXf(x, st.s);
      Y.fill_bytes(0xFF, st.s);
      cuda::rms_norm_forward(dXf.data(), dW.data(), Y.data(), nullptr, rows, n, 1e-6, zc, st.s);
      EXPECT_LE(test::rel_l2(to_host_f32(Y, st.s), y_ref.data), test::kTolBf16Out) << rows << "x" << n << " fp32 in";
      DeviceArray<bf16> Xo{size_t(rows * n + 4)};
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(Xo.data() + 4, dX.data(), size_t(rows * n) * 2, cudaMemcpyDeviceToDevice, st.s));
      Y.fill_bytes(0xFF, st.s);
      cuda::rms_norm_forward(Xo.data() + 4, dW.data(), Y.data(), nullptr, rows, n, 1e-6, zc, st.s);
      EXPECT_LE(test::rel_l2(to_host_f32(Y, st.s), y_ref.data), test::kTolBf16Out) << rows << "x" << n << " misaligned";
      // The backward in place (dx = dy, as the drafter's q / k norms), without dw.
      auto DYc = to_device_bf16(dy, st.s);
      cuda::rms_norm_backward(dX.data(), dW.data(), inv.data(), DYc.data(), DYc.data(), nullptr, ws.data(), rows, n, zc,
                              st.s);
      EXPECT_LE(test::rel_l2(to_host_f32(DYc, st.s), dx_ref.data), test::kTolBf16Out) << rows << "x" << n << " in place";
    }
  }
}

TEST(CudaRope, FullAndPartialForwardAndInverse) {
  DFLASH_REQUIRE_GPU();
  Stream st;
  std::mt19937_64 rng(3);
  // (rot / 2 % 4 == 0: the kernel of 4 pairs per thread; 12: the pair-by-pair one)
  for (auto [n, H, D, rot] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{37, 3, 64, 64}, {100, 4, 256, 64},
                              {17, 2, 128, 128}, {9, 2, 64, 12}}) {
    RopeSpec spec;
    spec.theta = 1e6;
    const std::vector<float> inv_f = cpu::rope_inv_freq(spec, rot);
    std::vector<int64_t> pos(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) pos[size_t(t)] = int64_t(rng() % 5000);
    const auto x = rand_bf16_values(size_t(n * H * D), rng);
    BasicTensor<double> X({n, H, D});
    for (size_t i = 0; i < x.size(); ++i) X.data[i] = x[i];
    cpu::apply_rope(X, pos, inv_f, rot);
    std::vector<double> inv_d(inv_f.begin(), inv_f.end());
    DeviceArray<int64_t> dpos(pos, st.s);
    DeviceArray<double> dinv(inv_d, st.s);
    DeviceArray<float> c{size_t(n * rot / 2)}, s{size_t(n * rot / 2)};
    cuda::rope_table(dpos.data(), dinv.data(), n, rot, c.data(), s.data(), st.s);
    auto dx = to_device_bf16(x, st.s);
    cuda::rope_apply(dx.data(), n, H, D, rot, c.data(), s.data(), false, st.s);
    const auto y = to_host_f32(dx, st.s);
    EXPECT_LE(test::rel_l2(y, X.data), test::kTolBf16Out) << n << " " << H << " " << D << " " << rot;
    cuda::rope_apply(dx.data(), n, H, D, rot, c.data(), s.data(), true, st.s);  // the backward undoes it
    EXPECT_LE(test::rel_l2(to_host_f32(dx, st.s), x), 2 * test::kTolBf16Out);
  }
}

TEST(CudaElementwise, SwigluGatherAdd) {
  DFLASH_REQUIRE_GPU();
  Stream st;
  std::mt19937_64 rng(4);
  // gate_up rows of 2 I: I % 8 == 0 and aligned takes 16-byte accesses; I odd or a misaligned start
  // (off 1) one element at a time. 70001 rows: more than the grid's 65535 on y (its row loop).
  for (const auto& [rows, I] : {std::pair<int64_t, int64_t>{33, 1008}, {33, 1001}, {70001, 8}, {70001, 3}})
    for (const int64_t off : {0, 1}) {
      const int64_t n = rows * I;
      const auto gu = rand_bf16_values(size_t(2 * n), rng, 3.f), dy = rand_bf16_values(size_t(n), rng);
      BasicTensor<double> G({rows, I}), U({rows, I}), DY({rows, I});
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < I; ++c) {
          const size_t i = size_t(r * I + c);
          G.data[i] = gu[size_t(r * 2 * I + c)], U.data[i] = gu[size_t(r * 2 * I + I + c)], DY.data[i] = dy[i];
        }
      BasicTensor<double> dg_ref, du_ref, A = G;
      cpu::swiglu_backward(G, U, DY, &dg_ref, &du_ref);
      cpu::swiglu(A, U);
      std::vector<double> dgu_ref(size_t(2 * n));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < I; ++c) {
          dgu_ref[size_t(r * 2 * I + c)] = dg_ref.data[size_t(r * I + c)];
          dgu_ref[size_t(r * 2 * I + I + c)] = du_ref.data[size_t(r * I + c)];
        }
      std::vector<float> gu_off(size_t(off), 0.f), dy_off(size_t(off), 0.f);
      gu_off.insert(gu_off.end(), gu.begin(), gu.end()), dy_off.insert(dy_off.end(), dy.begin(), dy.end());
      auto dGU = to_device_bf16(gu_off, st.s), dDY = to_device_bf16(dy_off, st.s);
      DeviceArray<bf16> act{size_t(n + off)};
      act.fill_bytes(0xFF, st.s);  // NaN: every element must be written
      cuda::swiglu_forward(dGU.data() + off, rows, I, act.data() + off, st.s);
      cuda::swiglu_backward(dGU.data() + off, dDY.data() + off, rows, I, st.s);
      auto tailf = [&](const DeviceArray<bf16>& a) {
        const auto h = to_host_f32(a, st.s);
        return std::vector<float>(h.begin() + off, h.end());
      };
      EXPECT_LE(test::rel_l2(tailf(act), A.data), test::kTolBf16Out) << rows << " x " << I << " " << off;
      EXPECT_LE(test::rel_l2(tailf(dGU), dgu_ref), test::kTolBf16Out) << rows << " x " << I << " " << off;
    }

  // Rows of 72 (16-byte words) and of 9 elements (one by one).
  for (int64_t d : {72, 9}) {
    const int64_t V = 97;
    const auto table = rand_bf16_values(size_t(V * d), rng);
    std::vector<int32_t> ids = {0, 96, 5, 5, 40};
    auto dT = to_device_bf16(table, st.s);
    DeviceArray<int32_t> dids(ids, st.s);
    DeviceArray<bf16> out(ids.size() * size_t(d));
    DeviceArray<int> bad(std::vector<int>{0}, st.s);
    cuda::embedding_gather(dT.data(), V, d, dids.data(), int64_t(ids.size()), out.data(), bad.data(), st.s);
    const auto o = to_host_f32(out, st.s);
    for (size_t r = 0; r < ids.size(); ++r)
      for (int64_t c = 0; c < d; ++c) ASSERT_EQ(o[r * size_t(d) + size_t(c)], table[size_t(ids[r] * d + c)]);
    EXPECT_EQ(bad.to_host(st.s)[0], 0);
    ids[2] = 97;  // out of range: flagged, no crash
    DeviceArray<int32_t> dbad(ids, st.s);
    cuda::embedding_gather(dT.data(), V, d, dbad.data(), int64_t(ids.size()), out.data(), bad.data(), st.s);
    EXPECT_EQ(bad.to_host(st.s)[0], 1);
    for (int64_t c = 0; c < d; ++c) ASSERT_TRUE(std::isnan(to_host_f32(out, st.s)[size_t(2 * d + c)])) << c;

    // scatter_rows puts gathered rows back where they came from; the other rows stay 0.
    const std::vector<int32_t> dst = {96, 5, 0};
    DeviceArray<int32_t> ddst(dst, st.s);
    DeviceArray<bf16> back{size_t(V * d)};
    back.fill_bytes(0, st.s);
    const std::vector<int32_t> src_rows = {1, 3, 0};  // out rows holding table rows 96, 5, 0
    DeviceArray<bf16> picked{size_t(3 * d)};
    DeviceArray<int32_t> dsrc(src_rows, st.s);
    cuda::embedding_gather(out.data(), int64_t(ids.size()), d, dsrc.data(), 3, picked.data(), nullptr, st.s);
    cuda::scatter_rows(picked.data(), 3, d, ddst.data(), back.data(), st.s);
    const auto b = to_host_f32(back, st.s);
    for (int64_t r = 0; r < V; ++r)
      for (int64_t c = 0; c < d; ++c) {
        const double want = (r == 96 || r == 5 || r == 0) ? table[size_t(r * d + c)] : 0.0;
        ASSERT_EQ(b[size_t(r * d + c)], want) << r << " " << c;
      }

  }

  const int64_t n = 33 * 1001;  // 8-element packs, then a 1-element tail
  const auto g = rand_bf16_values(size_t(n), rng, 3.f), u = rand_bf16_values(size_t(n), rng);
  auto y = to_device_bf16(g, st.s), dU = to_device_bf16(u, st.s);
  cuda::add_inplace(y.data(), dU.data(), n, st.s);
  std::vector<double> sum(static_cast<size_t>(n));
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = double(g[i]) + u[i];
  EXPECT_LE(test::rel_l2(to_host_f32(y, st.s), sum), test::kTolBf16Out);
}

TEST(CudaAdamW, ClipAndThreeStepsBitwiseLikeTheCpu) {
  DFLASH_REQUIRE_GPU();
  Stream st;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  const int64_t n = 100003;
  std::vector<float> p(static_cast<size_t>(n));
  for (float& x : p) x = nd(rng);
  AdamWOptions o;
  o.weight_decay = 0.01;
  std::vector<float> cpu_p = p;
  AdamW<float> cpu_opt({"p"}, {n}, o);
  DeviceArray<float> dp(p, st.s), dg{size_t(n)}, dm{size_t(n)}, dv{size_t(n)};
  dm.fill_bytes(0, st.s);
  dv.fill_bytes(0, st.s);
  DeviceArray<bf16> dpb{size_t(n)};
  DeviceArray<double> sumsq(1), norm(1), ws{size_t(cuda::grad_sumsq_workspace_doubles())};
  DeviceArray<float> coef(1);
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g(static_cast<size_t>(n));
    for (float& x : g) x = 0.01f * nd(rng);
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dg.data(), g.data(), size_t(n) * 4, cudaMemcpyHostToDevice, st.s));
    cuda::grad_sumsq(dg.data(), n, sumsq.data(), ws.data(), st.s);
    cuda::clip_coefficient(sumsq.data(), 1.0, norm.data(), coef.data(), st.s);
    const double lr = 1e-3 * step;
    cuda::adamw_update(dp.data(), dg.data(), dm.data(), dv.data(), dpb.data(), n,
                       cuda::adamw_scalars(lr, o.beta1, o.beta2, o.eps, o.weight_decay, step), coef.data(), st.s);
    std::vector<NamedSpan<float>> cg{{"p", std::span<float>(g)}};
    const ClipResult clip = clip_grad_norm(cg, 1.0);
    EXPECT_LT(clip.coef, 1.0) << "clipping must be active";
    EXPECT_NEAR(norm.to_host(st.s)[0], clip.norm, 1e-12 * clip.norm);
    EXPECT_EQ(coef.to_host(st.s)[0], float(clip.coef));
    cpu_opt.step({{"p", std::span<float>(cpu_p)}}, {{"p", g}}, lr);
  }
  const auto gp = dp.to_host(st.s);
  int64_t diff = 0;
  for (size_t i = 0; i < gp.size(); ++i) diff += gp[i] != cpu_p[i];
  EXPECT_EQ(diff, 0) << "elements differing from the CPU AdamW";
  const auto pb = to_host_f32(dpb, st.s);
  for (size_t i = 0; i < pb.size(); ++i) ASSERT_EQ(pb[i], bf16_to_f32(f32_to_bf16(gp[i]))) << "bf16 copy, element " << i;
  EXPECT_EQ(dm.to_host(st.s), cpu_opt.exp_avg()[0]);
  EXPECT_EQ(dv.to_host(st.s), cpu_opt.exp_avg_sq()[0]);
}

#else

TEST(Cuda, NotBuilt) { GTEST_SKIP() << "built without CUDA (DFLASH_CUDA=OFF): GPU kernel tests not compiled"; }

#endif
