// The FP8 path of the GPU target (--target-dtype fp8): the per-row quantizer against its CPU reference
// (f32_to_fp8_e4m3), cuBLASLt's per-row scaled E4M3 product against the product of the dequantized
// operands, and the FP8 target's taps and logits against the bf16 target's on the fixtures.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <cmath>
#include <cstdio>

#include "cuda_test_util.h"
#include "models/cuda/target_gpu.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/gemm.h"
#include "tensor/dtype.h"
#include "test_util.h"

using namespace dflash;

namespace {

/// The fixture of the FP8 tests: skipped without a device, or on a GPU without FP8 products.
class CudaFp8 : public test::GpuTest {
 protected:
  void SetUp() override {
    test::GpuTest::SetUp();
    if (IsSkipped()) return;
    const std::string r = cuda::fp8_unsupported_reason();
    if (!r.empty()) GTEST_SKIP() << "this GPU has no FP8 products: " << r;
  }
};

/// CPU reference of quantize_rows_fp8 for x [rows, cols] (bf16 values): scales and codes.
void quantize_rows_reference(const std::vector<float>& x, int64_t rows, int64_t cols, std::vector<uint8_t>* q,
                             std::vector<float>* scale) {
  q->resize(x.size()), scale->resize(size_t(rows));
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(x[size_t(r * cols + c)]));
    const float s = amax > 0 ? std::max(amax / 448.f, 1e-30f) : 1.f, inv = 1.f / s;
    (*scale)[size_t(r)] = s;
    for (int64_t c = 0; c < cols; ++c) (*q)[size_t(r * cols + c)] = f32_to_fp8_e4m3(x[size_t(r * cols + c)] * inv);
  }
}

template <typename T>
std::vector<T> host(const cuda::DeviceArray<T>& d) {
  std::vector<T> h(d.size());
  DFLASH_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

/// `inner` with every projection (a 2-D weight of a layer) replaced by its per-output-channel E4M3
/// rounding, dequantized (the CPU reference): the weights an FP8 target computes with, alone.
class Fp8RoundedWeights : public WeightSource {
 public:
  explicit Fp8RoundedWeights(const WeightSource& inner) : inner_(inner) {}
  std::vector<std::string> names() const override { return inner_.names(); }
  bool has(const std::string& n) const override { return inner_.has(n); }
  TensorInfo info(const std::string& n) const override { return inner_.info(n); }
  std::string origin() const override { return inner_.origin(); }
  Tensor load_f32(const std::string& n) const override {
    Tensor t = inner_.load_f32(n);
    if (t.ndim() != 2 || n.find("layers.") == std::string::npos || n.find("router") != std::string::npos) return t;
    std::vector<float> bf(t.data.size());
    for (size_t i = 0; i < bf.size(); ++i) bf[i] = bf16_to_f32(f32_to_bf16(t.data[i]));  // as uploaded
    std::vector<uint8_t> q;
    std::vector<float> sc;
    quantize_rows_reference(bf, t.dim(0), t.dim(1), &q, &sc);
    for (size_t i = 0; i < bf.size(); ++i) t.data[i] = fp8_e4m3_to_f32(q[i]) * sc[i / size_t(t.dim(1))];
    return t;
  }

 private:
  const WeightSource& inner_;
};

}  // namespace

TEST_F(CudaFp8, QuantizeRowsMatchesTheCpuReferenceBitForBit) {
  const int64_t rows = 37, cols = 300;
  std::mt19937_64 rng(3);
  std::vector<float> x = test::rand_bf16_values(size_t(rows * cols), rng, 2.f);
  for (int64_t c = 0; c < cols; ++c) x[size_t(5 * cols + c)] = 0.f;                 // a row of zeros: scale 1
  x[size_t(7 * cols + 3)] = bf16_to_f32(f32_to_bf16(1e4f));                          // one outlier in row 7
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    const auto xd = test::to_device_bf16(x, s);
    cuda::DeviceArray<cuda::fp8> q(x.size());
    cuda::DeviceArray<float> sc{size_t(rows)};
    cuda::quantize_rows_fp8(xd.data(), rows, cols, q.data(), sc.data(), s);
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<uint8_t> qr;
    std::vector<float> sr;
    quantize_rows_reference(x, rows, cols, &qr, &sr);
    EXPECT_EQ(host(sc), sr);
    EXPECT_EQ(host(q), qr);
    EXPECT_EQ(sr[5], 1.f);
    // and back: dequantize_rows_fp8 gives q * scale rounded to bf16
    cuda::DeviceArray<cuda::bf16> y(x.size());
    cuda::dequantize_rows_fp8(q.data(), sc.data(), rows, cols, y.data(), s);
    const std::vector<float> yh = test::to_host_f32(y, s);
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(yh[i], bf16_to_f32(f32_to_bf16(fp8_e4m3_to_f32(qr[i]) * sr[i / size_t(cols)]))) << i;
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

// C = beta C + a_scale[m] b_scale[n] sum_k A[m,k] B[n,k], fp32 and bf16 outputs, row counts that are
// not tile multiples: against the same sum over the dequantized E4M3 operands in double.
TEST_F(CudaFp8, ScaledProductMatchesTheDequantizedOperands) {
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  for (const auto& [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{37, 48, 64}, {1, 80, 160}, {600, 96, 512}}) {
    std::mt19937_64 rng(uint64_t(M * 7 + N));
    const std::vector<float> a = test::rand_bf16_values(size_t(M * K), rng, 1.f);
    const std::vector<float> b = test::rand_bf16_values(size_t(N * K), rng, 0.05f);
    const std::vector<float> c0 = test::rand_bf16_values(size_t(M * N), rng, 1.f);
    std::vector<uint8_t> qa, qb;
    std::vector<float> sa, sb;
    quantize_rows_reference(a, M, K, &qa, &sa);
    quantize_rows_reference(b, N, K, &qb, &sb);
    std::vector<double> ref(size_t(M * N));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += double(fp8_e4m3_to_f32(qa[size_t(m * K + k)])) * double(fp8_e4m3_to_f32(qb[size_t(n * K + k)]));
        ref[size_t(m * N + n)] = acc * double(sa[size_t(m)]) * double(sb[size_t(n)]);
      }
    cuda::GemmContext g(s);
    const cuda::DeviceArray<cuda::fp8> da(qa, s), db(qb, s);
    const cuda::DeviceArray<float> dsa(sa, s), dsb(sb, s);
    // fp32 output, accumulating into C (beta 1), as a product into the residual stream
    cuda::DeviceArray<float> cf(c0, s);
    g.gemm_fp8({M, N, K, false, true}, da.data(), dsa.data(), db.data(), dsb.data(), cf.data(), 1.f);
    const std::vector<float> got = host(cf);
    std::vector<float> want(got.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = float(ref[i] + double(c0[i]));
    const double e32 = test::rel_l2(got, want);
    // bf16 output, overwritten
    cuda::DeviceArray<cuda::bf16> cb(size_t(M * N));
    g.gemm_fp8({M, N, K, false, true}, da.data(), dsa.data(), db.data(), dsb.data(), cb.data());
    std::vector<float> ref32(ref.begin(), ref.end());
    const double e16 = test::rel_l2(test::to_host_f32(cb, s), ref32);
    std::printf("[fp8 gemm] M %ld N %ld K %ld: rel L2 fp32 out %.2e, bf16 out %.2e\n", long(M), long(N), long(K), e32, e16);
    EXPECT_LT(e32, test::kTolFp8Accumulate);  // exact E4M3 products, Hopper's narrow FP8 accumulator
    EXPECT_LT(e16, test::kTolBf16Out);        // and one bf16 rounding
  }
  cuda::GemmContext g(s);
  EXPECT_THROW(g.gemm_fp8({16, 16, 24, false, true}, nullptr, nullptr, nullptr, nullptr, static_cast<float*>(nullptr)),
               std::invalid_argument);  // K not a multiple of 16
  EXPECT_THROW(g.gemm_fp8({16, 16, 16, true, true}, nullptr, nullptr, nullptr, nullptr, static_cast<float*>(nullptr)),
               std::invalid_argument);
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

// The FP8 target against the bf16 target on the same fixture weights: every hidden state, the logits
// and the training taps, single and packed sequences. The bound calibrates itself: e_w, what rounding
// the weights alone to per-channel E4M3 moves the bf16 target's outputs (a CPU-quantized copy of the
// fixture run by the bf16 GPU path); the per-token activations have the same 3-bit mantissa, an error
// of the same size and independent, so the FP8 target stays within 2 e_w (sqrt(2) e_w expected).
// Also: the decoding path (cached forward) gives the uncached FP8 forward's logits.
TEST_F(CudaFp8, TargetTapsAndLogitsStayNearTheBf16Target) {
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  for (const char* name : {"qwen3_hd64", "qwen3_5_hd64"}) {
    const OpenedModel opened = open_model((test::fixtures_dir() / name).string());
    const auto model = TargetModel::from_weights(opened.spec, *opened.weights);
    const auto rounded = TargetModel::from_weights(opened.spec, Fp8RoundedWeights(*opened.weights));
    const int L = int(model->spec().num_hidden_layers);
    TargetGpu bf(*model, s), bf_rounded(*rounded, s), f8(*model, s, TargetDtype::kFp8);
    EXPECT_EQ(f8.dtype(), TargetDtype::kFp8);
    std::vector<int32_t> ids;
    std::mt19937 rng(11);
    for (int i = 0; i < 150; ++i) ids.push_back(int32_t(rng() % uint32_t(model->spec().vocab_size)));
    const std::vector<int64_t> cu = {0, 40, 150};
    ForwardOptions fo;
    for (int j = 0; j <= L; ++j) fo.hidden_states.push_back(j);
    const ForwardOutput a = bf.forward(ids, cu, fo), w = bf_rounded.forward(ids, cu, fo), b = f8.forward(ids, cu, fo);
    double worst_hidden = 0, worst_hidden_w = 0;
    for (int j = 1; j <= L; ++j) {
      worst_hidden = std::max(worst_hidden, test::rel_l2(b.hidden_states.at(j).data, a.hidden_states.at(j).data));
      worst_hidden_w = std::max(worst_hidden_w, test::rel_l2(w.hidden_states.at(j).data, a.hidden_states.at(j).data));
    }
    const double logits = test::rel_l2(b.logits.data, a.logits.data), logits_w = test::rel_l2(w.logits.data, a.logits.data);
    std::printf("[fp8 target] %s vs the bf16 target: worst hidden state rel L2 %.3e (E4M3 weights alone %.3e), "
                "logits %.3e (weights alone %.3e)\n", name, worst_hidden, worst_hidden_w, logits, logits_w);
    EXPECT_GT(logits_w, 0.0);
    EXPECT_LT(worst_hidden, 2 * worst_hidden_w) << name;
    EXPECT_LT(logits, 2 * logits_w) << name;
    // taps of the last layer (after the final norm) and layer 0
    const int64_t T = int64_t(ids.size()), D = model->spec().hidden_size;
    cuda::DeviceArray<cuda::bf16> ta(size_t(T * 2 * D)), tb(size_t(T * 2 * D));
    bf.forward_taps(ids, cu, {0, int64_t(L - 1)}, ta.data());
    f8.forward_taps(ids, cu, {0, int64_t(L - 1)}, tb.data());
    const double taps = test::rel_l2(test::to_host_f32(tb, s), test::to_host_f32(ta, s));
    std::printf("[fp8 target] %s: taps rel L2 vs bf16 %.3e\n", name, taps);
    EXPECT_LT(taps, 2 * worst_hidden_w) << name;
    // decoding: prefill 40 tokens, then 3 decoding steps of 1 token: the logits of the uncached forward
    f8.reset_cache(1);
    ForwardOptions lo;
    const std::vector<int32_t> pre(ids.begin(), ids.begin() + 40);
    f8.forward_cached(pre, {0, 40}, lo);
    const ForwardOutput full = f8.forward(std::vector<int32_t>(ids.begin(), ids.begin() + 43), {0, 43}, lo);
    const int64_t V = model->spec().vocab_size;
    for (int t = 40; t < 43; ++t) {
      const ForwardOutput step = f8.forward_cached({ids[size_t(t)]}, {0, 1}, lo);
      const std::vector<float> want(full.logits.data.begin() + t * V, full.logits.data.begin() + (t + 1) * V);
      EXPECT_LT(test::rel_l2(step.logits.data, want), 2e-2) << name << " decoding step " << t;
    }
  }
  // A target whose projection inputs are not multiples of 16 is refused, naming them, never run in bf16.
  const auto moe = TargetModel::load((test::fixtures_dir() / "qwen3_5_moe_hd64").string());
  try {
    TargetGpu g(*moe, s, TargetDtype::kFp8);
    ADD_FAILURE() << "hidden_size 40 ran in FP8";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

#endif
