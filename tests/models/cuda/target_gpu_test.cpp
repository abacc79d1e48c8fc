// The target forward on the GPU (bf16) against transformers' goldens (tests/fixtures/qwen3_hd64 and the
// Qwen3.5 hybrids qwen3_5_text_hd64 / qwen3_5_hd64 and the MoE targets qwen3_5_moe_hd64 / qwen3_next_hd64,
// head_dim 64: the smallest head the GPU attention takes), single sequences and a packed batch; the
// training taps equal the forward's hidden states; models the GPU backend cannot run are refused
// with the reason.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <algorithm>
#include <cstring>
#include <map>

#include "models/cuda/target_gpu.h"
#include "tensor/dtype.h"
#include "cuda_test_util.h"
#include "test_util.h"

using namespace dflash;

namespace {

ForwardOptions all_outputs(int L) {
  ForwardOptions o;
  for (int j = 0; j <= L; ++j) o.hidden_states.push_back(j);
  return o;
}

/// The GPU forward of fixture `name` against its transformers golden `file`: every sequence alone
/// (logits and every hidden state) and the three packed longest first. Returns the worst logits error.
double check_against_golden(const std::string& name, TargetGpu& gpu, const TargetModel& model,
                            const std::string& file = "golden.safetensors") {
  const test::TargetGolden g = test::load_target_golden(test::fixtures_dir() / name, file);
  EXPECT_EQ(g.ids.size(), 3u);
  const int L = g.num_layers;
  double worst = 0;
  for (size_t q = 0; q < g.ids.size(); ++q) {
    const auto out = gpu.forward(g.ids[q], {0, int64_t(g.ids[q].size())}, all_outputs(L));
    const double e = test::rel_l2(out.logits.data, g.logits[q].data);
    worst = std::max(worst, e);
    EXPECT_LE(e, test::kTolBf16Target) << name << " seq" << q << " logits";
    for (int j = 0; j <= L; ++j)
      EXPECT_LE(test::rel_l2(out.hidden_states.at(j).data, g.hidden[q][size_t(j)].data), test::kTolBf16Target)
          << name << " seq" << q << " hidden_states." << j;
  }
  // Packed: longest first; each sequence's rows must match its own golden.
  std::vector<int32_t> ids;
  std::vector<int64_t> cu{0};
  for (size_t q : {size_t(2), size_t(0), size_t(1)}) {
    ids.insert(ids.end(), g.ids[q].begin(), g.ids[q].end());
    cu.push_back(int64_t(ids.size()));
  }
  const auto packed = gpu.forward(ids, cu, all_outputs(L));
  const int64_t V = model.spec().vocab_size;
  size_t part = 0;
  for (size_t q : {size_t(2), size_t(0), size_t(1)}) {
    const std::vector<float> rows(packed.logits.data.begin() + cu[part] * V, packed.logits.data.begin() + cu[part + 1] * V);
    const double e = test::rel_l2(rows, g.logits[q].data);
    worst = std::max(worst, e);
    EXPECT_LE(e, test::kTolBf16Target) << name << " packed seq" << q;
    ++part;
  }
  std::printf("[gpu target] %s worst logits rel L2 vs transformers %s (bf16 GPU path): %.2e\n", name.c_str(),
              file.c_str(), worst);
  return worst;
}
}  // namespace

TEST(CudaTarget, Qwen3MatchesTransformersInBf16) {
  DFLASH_REQUIRE_GPU();
  const auto dir = test::fixtures_dir() / "qwen3_hd64";
  const test::TargetGolden g = test::load_target_golden(dir);
  const auto model = TargetModel::load(dir.string());
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    TargetGpu gpu(*model, s);
    const int L = g.num_layers;
    check_against_golden("qwen3_hd64", gpu, *model);

    // Taps of layers {1, 0} for the 100-token sequence: layer 1 (the last) is hidden_states[2], after
    // the final norm as in transformers; layer 0 equals hidden_states[1] rounded to bf16.
    const std::vector<int32_t>& ids2 = g.ids[2];
    const int64_t T = int64_t(ids2.size()), D = model->spec().hidden_size;
    cuda::DeviceArray<cuda::bf16> taps(size_t(T * 2 * D));
    gpu.forward_taps(ids2, {0, T}, {1, 0}, taps.data());
    std::vector<uint16_t> h(taps.size());
    DFLASH_CUDA_CHECK(cudaMemcpy(h.data(), taps.data(), h.size() * 2, cudaMemcpyDeviceToHost));
    const auto one = gpu.forward(ids2, {0, T}, all_outputs(L));
    std::vector<float> tap1(static_cast<size_t>(T * D));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < D; ++c) {
        tap1[size_t(t * D + c)] = bf16_to_f32(h[size_t(t * 2 * D + c)]);
        ASSERT_EQ(h[size_t(t * 2 * D + D + c)], f32_to_bf16(one.hidden_states.at(1).data[size_t(t * D + c)]));
      }
    EXPECT_LE(test::rel_l2(tap1, g.hidden[2][2].data), test::kTolBf16Target);
    EXPECT_THROW(gpu.forward_taps(ids2, {0, T}, {2}, taps.data()), std::invalid_argument);
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

// Qwen3.5 hybrids (GatedDeltaNet + gated attention with partial RoPE and zero-centered norms), text
// and multimodal wrapper formats, head_dim 64: the whole forward on the GPU against transformers' exact
// forward of the same bf16-rounded weights the GPU holds (golden_bf16_weights.safetensors), which
// measures the GPU path's own error (make_fixtures.py prints what the weights' rounding alone moves).
// These fixtures' linear layers have half gain: at full gain, even a CPU emulation of bf16 GEMM inputs
// is 1.6% off on them (scripts/make_fixtures.py, BF16_LINEAR_GAIN).
TEST(CudaTarget, Qwen3_5HybridsMatchTransformersInBf16) {
  DFLASH_REQUIRE_GPU();
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  for (const char* name : {"qwen3_5_text_hd64", "qwen3_5_hd64"}) {
    const auto model = TargetModel::load((test::fixtures_dir() / name).string());
    TargetGpu gpu(*model, s);
    check_against_golden(name, gpu, *model, "golden_bf16_weights.safetensors");
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

// Mixture-of-experts targets (Qwen3.5-MoE wrapper: every layer sparse, renormalized top 3 of 8, a shared
// expert; Qwen3-Next: fused projections, a dense layer, no renormalization), same method as above.
TEST(CudaTarget, MixtureOfExpertsMatchTransformersInBf16) {
  DFLASH_REQUIRE_GPU();
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  for (const char* name : {"qwen3_5_moe_hd64", "qwen3_next_hd64"}) {
    const auto model = TargetModel::load((test::fixtures_dir() / name).string());
    TargetGpu gpu(*model, s);
    check_against_golden(name, gpu, *model, "golden_bf16_weights.safetensors");
    // the taps path runs the same layers
    const std::vector<int32_t> ids{5, 17, 3, 99, 42, 7, 150};
    const int64_t T = int64_t(ids.size()), D = model->spec().hidden_size;
    cuda::DeviceArray<cuda::bf16> taps(size_t(T * D));
    gpu.forward_taps(ids, {0, T}, {1}, taps.data());
    ForwardOptions o;
    o.hidden_states = {2};
    const auto one = gpu.forward(ids, {0, T}, o);
    std::vector<uint16_t> h(taps.size());
    DFLASH_CUDA_CHECK(cudaMemcpy(h.data(), taps.data(), h.size() * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < T * D; ++i) ASSERT_EQ(h[size_t(i)], f32_to_bf16(one.hidden_states.at(2).data[size_t(i)]));
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

// Stage timing (bench target-forward's breakdown) names each kind of work the model has, with a positive
// GPU time, and leaves the results bit for bit as they were; off, it reports nothing.
TEST(CudaTarget, StageTimingNamesEachKindOfWorkAndChangesNoResult) {
  DFLASH_REQUIRE_GPU();
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  const std::vector<int32_t> ids{5, 17, 3, 99, 42, 7, 150, 8, 1};
  const int64_t T = int64_t(ids.size());
  for (const char* name : {"qwen3_5_text_hd64", "qwen3_5_moe_hd64", "qwen3_hd64"}) {
    const auto model = TargetModel::load((test::fixtures_dir() / name).string());
    const ModelSpec& sp = model->spec();
    TargetGpu gpu(*model, s);
    ForwardOptions o;
    o.logits = true;
    const auto plain = gpu.forward(ids, {0, T}, o);
    EXPECT_TRUE(gpu.last_stage_ms().empty());
    gpu.time_stages(true);
    const auto timed = gpu.forward(ids, {0, T}, o);
    EXPECT_EQ(plain.logits.data, timed.logits.data) << name;
    std::map<std::string, double> st;
    for (const auto& [n, ms] : gpu.last_stage_ms()) st[n] = ms;
    std::vector<std::string> want{"gemm", "attention", "other", "lm_head"};
    if (std::count(sp.layer_types.begin(), sp.layer_types.end(), LayerKind::GatedDeltaNet)) want.push_back("gated_deltanet");
    if (sp.num_experts > 0) want.push_back("moe");
    EXPECT_EQ(st.size(), want.size()) << name;
    for (const auto& n : want) EXPECT_GT(st[n], 0.0) << name << " stage " << n;
    // the taps path: no LM head
    cuda::DeviceArray<cuda::bf16> taps(size_t(T * sp.hidden_size));
    gpu.forward_taps(ids, {0, T}, {0}, taps.data());
    st.clear();
    for (const auto& [n, ms] : gpu.last_stage_ms()) st[n] = ms;
    EXPECT_EQ(st.count("lm_head"), 0u) << name;
    EXPECT_GT(st["gemm"], 0.0) << name;
    gpu.time_stages(false);
    EXPECT_TRUE(gpu.last_stage_ms().empty());
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(CudaTarget, RefusesWhatItCannotRunAndSaysWhy) {
  const auto hybrid = TargetModel::load((test::fixtures_dir() / "qwen3_5_text").string());
  EXPECT_NE(gpu_unsupported_reason(hybrid->spec()).find("head_dim 16"), std::string::npos);
  ModelSpec wide = hybrid->spec();
  wide.head_dim = 64;
  EXPECT_EQ(gpu_unsupported_reason(wide), "");
  wide.linear_value_head_dim = 256;
  EXPECT_NE(gpu_unsupported_reason(wide).find("GatedDeltaNet head dims"), std::string::npos);
  const auto small_heads = TargetModel::load((test::fixtures_dir() / "qwen3").string());
  EXPECT_NE(gpu_unsupported_reason(small_heads->spec()).find("head_dim 16"), std::string::npos);
  const auto ok = TargetModel::load((test::fixtures_dir() / "qwen3_hd64").string());
  EXPECT_EQ(gpu_unsupported_reason(ok->spec()), "");
  ModelSpec moe = wide;
  moe.linear_value_head_dim = 64;
  moe.hidden_size = 48, moe.num_experts = 8, moe.num_experts_per_tok = 2, moe.moe_intermediate_size = 24;
  EXPECT_EQ(gpu_unsupported_reason(moe), "");
  moe.moe_intermediate_size = 20;
  EXPECT_NE(gpu_unsupported_reason(moe).find("multiples of 8"), std::string::npos);
  moe.moe_intermediate_size = 24, moe.num_experts = 2048;
  EXPECT_NE(gpu_unsupported_reason(moe).find("1024 experts"), std::string::npos);
}

#endif
