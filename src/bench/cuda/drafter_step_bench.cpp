#include "bench/cuda/drafter_step_bench.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "bench/cuda/bench_util.h"
#include "train/cuda/memory_plan.h"
#include "bench/presets.h"
#include "models/cuda/drafter_gpu.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/dflash_attention.h"

namespace dflash {

namespace {

/// Model FLOPs of one training step (counted as the PyTorch measurement of the same step counts them): every drafter GEMM forward +
/// input gradient + weight gradient (fc: no input gradient), the LM head forward + input gradient,
/// attention over the visible keys only (backward = 2.5 x forward).
double step_flops(const DrafterConfig& c, int64_t V, int64_t S, int64_t Q, double visible_keys) {
  const double d = double(c.hidden_size), hd = double(c.head_dim), H = double(c.num_attention_heads),
               Hkv = double(c.num_key_value_heads), I = double(c.intermediate_size), K = double(c.target_layer_ids.size());
  const double layer = 2.0 * (double(Q) * d * H * hd * 2 + 2.0 * double(S + Q) * d * Hkv * hd + 3.0 * double(Q) * d * I);
  const double attn = 4.0 * hd * H * visible_keys;
  return double(c.num_hidden_layers) * (3.0 * layer + 3.5 * attn) + 2.0 * 2.0 * double(S) * K * d * d +
         2.0 * 2.0 * double(Q) * d * double(V);
}

}  // namespace

int run_drafter_step_bench(const DrafterStepBenchOptions& o) {
  DrafterBenchPreset p = drafter_bench_preset(o.preset, "bench drafter-step");
  if (o.seq > 0) p.S = o.seq;
  const DrafterConfig& c = p.cfg;
  const int64_t S = p.S, B = c.block_size;
  cuda::require_device("bench drafter-step");
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  const double gemm_peak = gemm_peak_tflops(s);

  PeakMemory mem;
  DrafterGpu gpu(c, p.V, 1234, s);
  cuda::DeviceArray<cuda::bf16> taps(size_t(S * int64_t(c.target_layer_ids.size()) * c.hidden_size));
  cuda::fill_normal(taps.data(), int64_t(taps.size()), 99, 0.f, 1.f, s);
  mem.static_done(s);

  DrafterGpuSequence seq = bench_sequence(c, S, o.anchors, taps.data());
  seq.dpace = o.dpace;
  double visible = 0;
  for (const auto& r : cpu::dflash_kv_ranges(seq.anchors, seq.num_blocks, B, S, 0, false))
    visible += double(r.ctx_end - r.ctx_begin + r.blk_end - r.blk_begin);
  const int64_t Q = seq.num_blocks * B;

  std::vector<double> ms;
  double loss = 0;
  const auto sampler = sample_current_gpu();  // the GPU's clock and power during the timed steps
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    if (i == o.warmup) sampler->take();
    const auto t0 = std::chrono::steady_clock::now();
    loss = bench_train_step(gpu, seq, o.recompute, i + 1);
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= o.warmup) ms.push_back(dt);
  }
  const PowerSummary power = sampler->take()[0];
  // One more step with per-stage GPU timings (where the time goes), and the optimizer alone.
  const nlohmann::json stages = timed_train_step(gpu, seq, o.recompute, o.warmup + o.steps + 1);
  const double peak_gb = mem.peak_gb();
  // The step's products alone, each back to back at the sustained (power-capped) clock, and with the
  // optimizer's time (memory bound): what is left of step_ms with every other kernel (attention, norms,
  // SwiGLU, RoPE, cross-entropy rows) at zero time. Between such kernels the GEMMs of a step can run a little
  // faster than back to back (the clock recovers), so this is an estimate, not a strict bound.
  std::vector<cuda::GemmCall> calls;
  gpu.gemm().record_calls(&calls);
  bench_train_step(gpu, seq, o.recompute, o.warmup + o.steps + 2);
  gpu.gemm().record_calls(nullptr);
  const SustainedGemms sg = sustained_gemms(calls, gpu.gemm().tunes_by_default(), s);
  const double step_ms = median(ms);
  const double flops = step_flops(c, p.V, S, Q, visible);
  const double tflops = flops / (step_ms * 1e-3) / 1e12;
  const nlohmann::json extra = {{"S", S}, {"anchors", seq.num_blocks}, {"block_size", B}, {"layers", c.num_hidden_layers},
                                {"hidden", c.hidden_size}, {"vocab", p.V}, {"steps", o.steps}, {"warmup", o.warmup},
                                {"min_ms", *std::min_element(ms.begin(), ms.end())},
                                {"max_ms", *std::max_element(ms.begin(), ms.end())}, {"loss", loss},
                                {"model_tflop_per_step", flops / 1e12}, {"achieved_tflops", tflops},
                                {"gemm_peak_tflops_8192", gemm_peak}, {"recompute", o.recompute}, {"dpace", o.dpace},
                                {"params", gpu.num_params()}, {"stage_ms", stages},
                                {"gemm_sustained_ms", sg.ms}, {"gemm_sustained_tflop", sg.tflop},
                                {"gemm_sustained_shapes", sg.shapes},
                                {"gemm_sustained_plus_optimizer_ms", sg.ms + stages["optimizer"].get<double>()},
                                {"power", power_json(power)}, {"peak_parts", mem.parts()},
                                {"planned_gb", (double(DrafterGpu::state_bytes(c, p.V) + 2 * int64_t(taps.size())) +
                                                pool_reserved(double(DrafterGpu::step_bytes(c, p.V, S, seq.num_blocks,
                                                                                            o.recompute)))) / 1e9},
                                {"what", "zero_grads + forward + backward + clip + AdamW"}};
  fmt::print("bench drafter-step: the GPU during the timed steps: {}\n", power.words());
  emit_bench_records("drafter-step", o.preset + (o.recompute ? "+recompute" : "") + (o.dpace ? "+dpace" : ""),
                     {{"step_ms", step_ms, "ms"}, {"peak_gb", peak_gb, "GB"}}, extra, o.results, o.record);
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

}  // namespace dflash
