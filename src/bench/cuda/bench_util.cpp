#include "bench/cuda/bench_util.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <stdexcept>
#include <string>

#include "bench/record.h"
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
    if (record) r = append_bench_record(results, r, true);
    fmt::print("{}\n", to_json(r).dump());
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

nlohmann::json timed_train_step(DrafterGpu& d, const DrafterGpuSequence& seq, bool recompute, int64_t t) {
  d.zero_grads();
  DrafterGpuStepOptions so;
  so.time_stages = true;
  so.recompute = recompute;
  const DrafterGpuStepResult r = d.step(seq, so);
  const auto t0 = std::chrono::steady_clock::now();
  d.optimizer_step(AdamWOptions{}, 6e-4, 1.0, t);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(d.stream()));
  nlohmann::json stages = nlohmann::json::object();
  for (const auto& [name, v] : r.stage_ms) stages[name] = v;
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

double PeakMemory::peak_gb() const {
  uint64_t pool_high = 0;
  DFLASH_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &pool_high));
  return (double(free0_ - free1_) + double(pool_high)) / 1e9;
}

}  // namespace dflash
