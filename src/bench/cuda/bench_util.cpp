#include "bench/cuda/bench_util.h"


#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <stdexcept>
#include <string>

#include "bench/record.h"
#include "gpu/device_info.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/gemm.h"
#include "train/anchors.h"

namespace dflash {

void emit_bench_records(const std::string& bench, const std::string& preset,
                        const std::vector<std::tuple<std::string, double, std::string>>& metrics,
                        const nlohmann::json& extra, const std::string& results, bool record) {
  for (const auto& [metric, value, unit] : metrics) {
    BenchRecord r;
    r.bench = bench;
    r.preset = preset;
    r.metric = metric;
    r.value = value;
    r.unit = unit;
    r.extra = extra;
    const char* tune[] = {"auto", "off", "on", "log"};  // GemmTune (DFLASH_GEMM_TUNE)
    r.extra["gemm_tune"] = tune[int(cuda::gemm_tune_mode())];
    print_bench_record(results, r, record, true);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

DrafterGpuSequence bench_sequence(const DrafterConfig& c, int64_t S, int64_t anchors, const cuda::bf16* taps) {
  std::mt19937_64 rng(7);
  DrafterGpuSequence seq;
  seq.taps = taps;
  std::vector<uint8_t> mask(static_cast<size_t>(S));
  for (int64_t t = 0; t < S; ++t) {
    seq.ids.push_back(int64_t(rng() % uint64_t(c.mask_token_id)));
    mask[size_t(t)] = t >= S / 10;
    seq.loss_mask.push_back(mask[size_t(t)]);
  }
  seq.anchors = sample_anchors(mask, anchors, rng);
  if (seq.anchors.empty())
    throw std::invalid_argument("bench: a sequence of " + std::to_string(S) + " tokens has no anchor position (use a longer --seq)");
  seq.num_blocks = int64_t(seq.anchors.size());
  seq.gamma = 7.0;
  return seq;
}

double bench_train_step(DrafterGpu& d, const DrafterGpuSequence& seq, bool recompute, int64_t t) {
  d.zero_grads();
  DrafterGpuStepOptions so;
  so.recompute = recompute;
  const double loss = d.step(seq, so).loss;
  d.optimizer_step(AdamWOptions{}, 6e-4, 1.0, t);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(d.stream()));  // the AdamW update runs asynchronously
  return loss;
}

nlohmann::json stage_json(const std::vector<std::pair<std::string, double>>& stage_ms) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, v] : stage_ms) j[name] = v;
  return j;
}

nlohmann::json timed_train_step(DrafterGpu& d, const DrafterGpuSequence& seq, bool recompute, int64_t t) {
  d.zero_grads();
  DrafterGpuStepOptions so;
  so.time_stages = true;
  so.recompute = recompute;
  const DrafterGpuStepResult r = d.step(seq, so);
  const auto t0 = std::chrono::steady_clock::now();
  d.optimizer_step(AdamWOptions{}, 6e-4, 1.0, t);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(d.stream()));
  nlohmann::json stages = stage_json(r.stage_ms);
  stages["optimizer"] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return stages;
}

PeakMemory::PeakMemory() {
  DFLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool_, 0));
  uint64_t keep = UINT64_MAX;
  DFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
  size_t total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free0_, &total));
}

void PeakMemory::static_done(cudaStream_t s) {
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  size_t total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free1_, &total));
  uint64_t zero = 0;
  DFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero));
}

nlohmann::json PeakMemory::parts() const {
  uint64_t pool_high = 0;
  DFLASH_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &pool_high));
  return {{"static_gb", double(free0_ - free1_) / 1e9}, {"pool_high_gb", double(pool_high) / 1e9}};
}

double PeakMemory::peak_gb() const {
  const nlohmann::json p = parts();
  return p["static_gb"].get<double>() + p["pool_high_gb"].get<double>();
}

std::vector<double> time_runs(cudaStream_t s, int warmup, int runs, const std::function<void()>& f) {
  cudaEvent_t e0, e1;
  DFLASH_CUDA_CHECK(cudaEventCreate(&e0));
  DFLASH_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < warmup + runs; ++i) {
    DFLASH_CUDA_CHECK(cudaEventRecord(e0, s));
    f();
    DFLASH_CUDA_CHECK(cudaEventRecord(e1, s));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= warmup) t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return t;
}

double gemm_peak_tflops(cudaStream_t s) {
  const int64_t n = 8192;
  cuda::GemmContext g(s);
  cuda::DeviceArray<cuda::bf16> a(size_t(n * n)), b(size_t(n * n)), c(size_t(n * n));
  cuda::fill_normal(a.data(), n * n, 1, 0.f, 1.f, s);
  cuda::fill_normal(b.data(), n * n, 2, 0.f, 1.f, s);
  const auto t = time_runs(s, 3, 10, [&] { g.gemm({n, n, n, false, true}, a.data(), b.data(), c.data()); });
  return 2.0 * double(n) * n * n / (median(t) * 1e-3) / 1e12;
}

std::unique_ptr<PowerSampler> sample_current_gpu() {
  int dev = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  std::string bus;
  for (const cuda::DeviceInfo& d : cuda::devices())
    if (d.index == dev) bus = d.pci_bus_id;
  return std::make_unique<PowerSampler>(std::vector<std::string>{bus}, 10);
}

nlohmann::json power_json(const PowerSummary& p) {
  if (p.samples == 0) return nullptr;
  return {{"samples", p.samples},           {"sm_clock_mhz", p.sm_clock_mhz}, {"sm_clock_max_mhz", p.sm_clock_max_mhz},
          {"power_w", p.power_w},           {"power_limit_w", p.power_limit_w},
          {"power_capped", p.power_capped}, {"thermal", p.thermal},   {"hw_slowdown", p.hw_slowdown}};
}

SustainedGemms sustained_gemms(const std::vector<cuda::GemmCall>& calls, bool tuned, cudaStream_t s, double min_ms) {
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, bool, bool, bool>;
  std::map<Key, int> count;
  int64_t a_max = 0, b_max = 0, c_max = 0;
  for (const cuda::GemmCall& c : calls) {
    const cuda::GemmShape& g = c.shape;
    ++count[{g.M, g.N, g.K, g.trans_a, g.trans_b, c.c_is_f32, c.accumulate, c.fp8}];
    a_max = std::max(a_max, g.M * g.K), b_max = std::max(b_max, g.K * g.N);
    c_max = std::max(c_max, g.M * g.N * (c.c_is_f32 ? 2 : 1));  // in bf16 elements
  }
  SustainedGemms r;
  if (count.empty()) return r;
  cuda::DeviceArray<cuda::bf16> a{size_t(a_max)}, b{size_t(b_max)}, c{size_t(c_max)};
  cuda::fill_normal(a.data(), a_max, 11, 0.f, 1.f, s);
  cuda::fill_normal(b.data(), b_max, 12, 0.f, 0.02f, s);
  const bool any_fp8 = std::any_of(calls.begin(), calls.end(), [](const cuda::GemmCall& c) { return c.fp8; });
  const int64_t rows_max = any_fp8 ? std::max(a_max, b_max) : 0;  // scales: one per row (M or N)
  cuda::DeviceArray<cuda::fp8> a8{size_t(any_fp8 ? a_max : 0)}, b8{size_t(any_fp8 ? b_max : 0)};
  cuda::DeviceArray<float> a8s{size_t(rows_max)}, b8s{size_t(rows_max)};
  cuda::GemmContext g(s, size_t(32) << 20, tuned);
  for (const auto& [key, n] : count) {
    const int64_t M = std::get<0>(key), N = std::get<1>(key), K = std::get<2>(key);
    const bool ta = std::get<3>(key), tb = std::get<4>(key), f32 = std::get<5>(key), acc = std::get<6>(key);
    const bool f8 = std::get<7>(key);
    DFLASH_CUDA_CHECK(cudaMemsetAsync(c.data(), 0, size_t(M * N) * (f32 ? 4 : 2), s));
    if (f8) {  // the operands quantized as the target quantizes them
      cuda::quantize_rows_fp8(a.data(), M, K, a8.data(), a8s.data(), s);
      cuda::quantize_rows_fp8(b.data(), N, K, b8.data(), b8s.data(), s);
    }
    auto run = [&] {
      if (f8 && f32) g.gemm_fp8({M, N, K, ta, tb}, a8.data(), a8s.data(), b8.data(), b8s.data(),
                                reinterpret_cast<float*>(c.data()), acc ? 1.f : 0.f);
      else if (f8) g.gemm_fp8({M, N, K, ta, tb}, a8.data(), a8s.data(), b8.data(), b8s.data(), c.data(), acc ? 1.f : 0.f);
      else if (f32) g.gemm({M, N, K, ta, tb}, a.data(), b.data(), reinterpret_cast<float*>(c.data()), 1.f, acc ? 1.f : 0.f);
      else g.gemm({M, N, K, ta, tb}, a.data(), b.data(), c.data(), 1.f, acc ? 1.f : 0.f);
    };
    const double once = time_runs(s, 1, 1, run)[0];  // after the tuning call
    const int reps = std::max(1, int(std::ceil(min_ms / std::max(once, 1e-3))));
    const double ms = time_runs(s, 0, 1, [&] {
                        for (int i = 0; i < reps; ++i) run();
                      })[0] / reps;
    r.ms += ms * n;
    r.tflop += 2.0 * double(M) * double(N) * double(K) * n / 1e12;
    ++r.shapes;
  }
  return r;
}

}  // namespace dflash
