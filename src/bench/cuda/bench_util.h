// Pieces shared by the GPU benchmarks (drafter-step, pipeline, gdn, target-forward): the training sample, the drafter's
// training step as they time it, and the peak-memory measurement.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/cuda/drafter_gpu.h"
#include "ops/cuda/gemm.h"
#include "train/gpu_power.h"

namespace dflash {

/// Prints one JSON line per (metric, value, unit) of `bench` / `preset` with `extra`, and when `record`
/// appends them to results/<bench>.jsonl (+ .md) through append_bench_record.
void emit_bench_records(const std::string& bench, const std::string& preset,
                        const std::vector<std::tuple<std::string, double, std::string>>& metrics,
                        const nlohmann::json& extra, const std::string& results, bool record);

/// Milliseconds of each of `runs` calls of f (work enqueued on `s`, timed by CUDA events around
/// it) after `warmup` untimed ones.
std::vector<double> time_runs(cudaStream_t s, int warmup, int runs, const std::function<void()>& f);

/// bf16 GEMM throughput (TFLOP/s) of cuBLASLt at 8192^3 on `s`, median of 10 after 3 warm-ups.
double gemm_peak_tflops(cudaStream_t s);

/// The cuBLASLt products of a step or forward, each timed alone: how long they take at the GPU's
/// sustained (power-capped) clock, an estimate of what the whole would take with every other kernel
/// (and any product outside cuBLASLt, e.g. the experts' grouped GEMMs) at zero time. Biased both ways:
/// operands stay hot in L2 and are freshly aligned, and between lower-power kernels the clock of a real
/// run recovers a little.
struct SustainedGemms {
  double ms = 0;     // sum over the calls of each product's mean time, ms
  double tflop = 0;  // their FLOPs (2 M N K each), 1e12
  int shapes = 0;    // distinct products timed
};
/// Times every distinct product of `calls` (shape, output type, beta 0 or 1, bf16 or FP8 operands:
/// FP8 ones quantized from the bf16 operands below) on a new GemmContext on
/// `s` that tunes as `tuned` (GemmContext's tune_by_default), one after the other: one call
/// (warm-up; it tunes the shape where no context of the process has), then back to back for at least `min_ms` (~100 ms: the GPU settles at its power cap, as in
/// a long run), its mean time counted once per call. Operands: A ~ N(0, 1) (activations), B ~ N(0, 0.02)
/// (weights), bf16; C zeroed. Allocates the largest operands once (cudaMalloc, outside the stream's
/// pool). Throws std::runtime_error on CUDA / cuBLASLt errors (out of memory).
SustainedGemms sustained_gemms(const std::vector<cuda::GemmCall>& calls, bool tuned, cudaStream_t s,
                               double min_ms = 100);

/// Samples the current CUDA device's SM clock and power (PowerSampler, every 10 ms) while alive.
std::unique_ptr<PowerSampler> sample_current_gpu();

/// A PowerSummary as the benchmarks record it ("power": {...}); null when nothing was sampled.
nlohmann::json power_json(const PowerSummary& p);

/// The upper median of v (v not empty).
double median(std::vector<double> v);

/// A chat-like training sequence of S tokens: the first 10 % is prompt (no loss), the rest response;
/// ids uniform in [0, c.mask_token_id), `anchors` anchors sampled from the response (fixed seed).
/// `taps` is stored as is (device [S, K*d]). Throws std::invalid_argument when S leaves no anchor.
DrafterGpuSequence bench_sequence(const DrafterConfig& c, int64_t S, int64_t anchors, const cuda::bf16* taps);

/// One training step as the benchmarks time it: zero_grads, forward + backward of `seq`, clip 1.0
/// and AdamW step t (1-based) at lr 6e-4. Synchronizes. Returns the loss.
double bench_train_step(DrafterGpu& d, const DrafterGpuSequence& seq, bool recompute, int64_t t);

/// Stage timings (name, ms) as a JSON object, in their order.
nlohmann::json stage_json(const std::vector<std::pair<std::string, double>>& stage_ms);

/// The same step with per-stage GPU timers: DrafterGpuStepResult::stage_ms (forward, attention_fwd,
/// cross_entropy, backward, attention_bwd) and "optimizer" (wall time of optimizer_step), in ms.
nlohmann::json timed_train_step(DrafterGpu& d, const DrafterGpuSequence& seq, bool recompute, int64_t t);

/// Peak memory of a benchmark on device 0: what its static allocations (weights, fixed buffers) took
/// from cudaMemGetInfo's free memory, plus the high-water mark of the stream-ordered pool (the
/// per-step temporaries) after them. Create it before the static allocations.
class PeakMemory {
 public:
  /// Sets the device's default pool to keep freed memory between steps (no OS round trips per
  /// step) and records the free memory. Throws std::runtime_error on CUDA errors.
  PeakMemory();
  /// After the static allocations: synchronizes `s`, records the free memory, resets the pool's
  /// high-water mark.
  void static_done(cudaStream_t s);
  /// Static bytes + the pool's high-water mark since static_done, in GB (1e9 bytes).
  double peak_gb() const;
  /// The two parts of peak_gb, in GB: {"static_gb", "pool_high_gb"}.
  nlohmann::json parts() const;

 private:
  cudaMemPool_t pool_{};
  size_t free0_ = 0, free1_ = 0;
};

}  // namespace dflash
