// The pieces of `dflash bench pipeline` on the GPU: TargetGpu with random weights made on the device
// (deterministic per seed, taps equal to its forward's hidden states, hybrids refused) and the tiny
// benchmark end to end (its three records); the products a step records and their sustained timing.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "bench/cuda/bench_util.h"
#include "bench/cuda/drafter_step_bench.h"
#include "bench/cuda/pipeline_bench.h"
#include "bench/presets.h"
#include "cuda_test_util.h"
#include "models/cuda/target_gpu.h"
#include "ops/cuda/elementwise.h"
#include "cuda_test_util.h"
#include "test_util.h"

using namespace dflash;

using CudaBench = test::GpuTest;

TEST_F(CudaBench, RandomTargetIsSeededAndItsTapsMatchItsForward) {
  const ModelSpec spec = pipeline_bench_preset("tiny").target;
  const int64_t T = 96, D = spec.hidden_size;
  std::mt19937_64 rng(3);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& t : ids) t = int32_t(rng() % uint64_t(spec.vocab_size));
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    TargetGpu a(spec, 5, s), b(spec, 5, s), c(spec, 6, s);
    cuda::DeviceArray<cuda::bf16> ta(size_t(T * 2 * D)), tb(ta.size()), tc(ta.size());
    a.forward_taps(ids, {0, T}, {1, 3}, ta.data());
    b.forward_taps(ids, {0, T}, {1, 3}, tb.data());
    c.forward_taps(ids, {0, T}, {1, 3}, tc.data());
    const std::vector<float> ha = test::to_host_f32(ta, s), hb = test::to_host_f32(tb, s), hc = test::to_host_f32(tc, s);
    EXPECT_TRUE(test::all_finite(ha));
    EXPECT_EQ(std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(float)), 0) << "same seed, other weights";
    EXPECT_GT(test::rel_l2(ha, hc), 0.1) << "another seed, the same weights";
    // Tap k of layer i is hidden_states[i + 1] rounded to bf16.
    ForwardOptions fo;
    fo.hidden_states = {2, 4};
    const ForwardOutput out = a.forward(ids, {0, T}, fo);
    EXPECT_TRUE(test::all_finite(out.logits.data));
    EXPECT_EQ(out.logits.shape, (std::vector<int64_t>{T, spec.vocab_size}));
    for (int64_t k = 0; k < 2; ++k)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < D; ++i)
          ASSERT_EQ(ha[size_t(t * 2 * D + k * D + i)],
                    bf16_to_f32(f32_to_bf16(out.hidden_states.at(int(2 + 2 * k)).data[size_t(t * D + i)])))
              << "tap " << k << " token " << t << " dim " << i;
  }
  // A target the GPU cannot run (attention head_dim 16) is refused with the reason, as from a checkpoint.
  const ModelSpec hybrid = TargetModel::load((test::fixtures_dir() / "qwen3_5_text").string())->spec();
  try {
    TargetGpu h(hybrid, 1, s);
    ADD_FAILURE() << "a head_dim 16 target was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 16"), std::string::npos) << e.what();
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

namespace {
/// Runs a benchmark's tiny preset (16 anchors, 2 steps after 1) into a temporary results directory;
/// returns its records of <bench>.jsonl by metric.
template <typename Options>
std::map<std::string, nlohmann::json> tiny_records(const std::string& bench, int (*run)(const Options&)) {
  test::TempDir d;
  Options o;
  o.preset = "tiny";
  o.anchors = 16, o.steps = 2, o.warmup = 1;
  o.results = d.path().string();
  EXPECT_EQ(run(o), 0);
  std::ifstream f(d / (bench + ".jsonl"));
  std::string line;
  std::map<std::string, nlohmann::json> by_metric;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    by_metric[j["metric"].get<std::string>()] = j;
  }
  return by_metric;
}
}  // namespace

TEST_F(CudaBench, PipelineTinyRecordsSamplesTokensAndPeakMemory) {
  const auto by_metric = tiny_records("pipeline", &run_pipeline_bench);
  ASSERT_EQ(by_metric.size(), 3u);
  const double sps = by_metric.at("samples_per_s")["value"].get<double>();
  EXPECT_GT(sps, 0);
  EXPECT_NEAR(by_metric.at("tokens_per_s")["value"].get<double>(), sps * 256, 1e-6 * sps * 256);
  EXPECT_GT(by_metric.at("peak_gb")["value"].get<double>(), 0);
  const nlohmann::json& x = by_metric.at("samples_per_s")["extra"];
  EXPECT_EQ(x["S"], 256);
  EXPECT_EQ(x["target_layers_run"], 6);  // taps [1..5] of 8 layers
  EXPECT_NEAR(x["sample_ms"].get<double>(), 1e3 / sps, 1e-9 * 1e3 / sps);
  EXPECT_TRUE(std::isfinite(x["loss"].get<double>()));
  for (const char* stage : {"target_forward", "drafter_forward", "drafter_cross_entropy", "drafter_backward",
                            "drafter_optimizer"})
    EXPECT_GT(x["stage_ms"][stage].get<double>(), 0) << stage;
}

TEST_F(CudaBench, SustainedGemmsTimeEachRecordedProductOncePerCall) {
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    cuda::GemmContext g(s);
    cuda::DeviceArray<cuda::bf16> a(64 * 128), b(128 * 96), cb(64 * 96);
    cuda::DeviceArray<float> cf(64 * 96);
    cuda::fill_normal(a.data(), 64 * 128, 1, 0.f, 1.f, s);
    cuda::fill_normal(b.data(), 128 * 96, 2, 0.f, 1.f, s);
    cuda::fill_normal(cb.data(), 64 * 96, 3, 0.f, 1.f, s);
    std::vector<cuda::GemmCall> log;
    g.gemm({8, 8, 8, false, true}, a.data(), b.data(), cf.data());  // before recording: not logged
    g.record_calls(&log);
    g.gemm({64, 96, 128, false, true}, a.data(), b.data(), cf.data());
    g.gemm({64, 96, 128, false, true}, a.data(), b.data(), cf.data());
    g.gemm({33, 40, 72, true, false}, a.data(), b.data(), cb.data(), 1.f, 1.f);
    g.record_calls(nullptr);
    g.gemm({8, 8, 8, false, true}, a.data(), b.data(), cf.data());  // after: not logged either
    ASSERT_EQ(log.size(), 3u);
    EXPECT_EQ(log[0].shape.M, 64);
    EXPECT_TRUE(log[0].c_is_f32);
    EXPECT_FALSE(log[0].accumulate);
    EXPECT_EQ(log[2].shape.K, 72);
    EXPECT_TRUE(log[2].shape.trans_a);
    EXPECT_FALSE(log[2].c_is_f32);
    EXPECT_TRUE(log[2].accumulate);
    const SustainedGemms r = sustained_gemms(log, false, s, 1.0);
    EXPECT_EQ(r.shapes, 2);
    EXPECT_DOUBLE_EQ(r.tflop, 2.0 * (2.0 * 64 * 96 * 128 + 33.0 * 40 * 72) / 1e12);
    EXPECT_GT(r.ms, 0);
    EXPECT_TRUE(std::isfinite(r.ms));
    EXPECT_EQ(sustained_gemms({}, false, s).shapes, 0);
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST_F(CudaBench, DrafterStepTinyRecordsItsProductsTimedAlone) {
  const auto by_metric = tiny_records("drafter-step", &run_drafter_step_bench);
  ASSERT_EQ(by_metric.count("step_ms"), 1u);
  const nlohmann::json& x = by_metric.at("step_ms")["extra"];
  // Every product of the step (the cross entropy's and the fc's included) is timed, and only products:
  // their FLOPs are positive and below the model count, which adds the attention.
  EXPECT_GT(x["gemm_sustained_shapes"].get<int>(), 10);
  EXPECT_GT(x["gemm_sustained_tflop"].get<double>(), 0);
  EXPECT_LT(x["gemm_sustained_tflop"].get<double>(), x["model_tflop_per_step"].get<double>());
  EXPECT_GT(x["gemm_sustained_ms"].get<double>(), 0);
  EXPECT_NEAR(x["gemm_sustained_plus_optimizer_ms"].get<double>(),
              x["gemm_sustained_ms"].get<double>() + x["stage_ms"]["optimizer"].get<double>(), 1e-9);
}

#endif
