#include "bench/cuda/drafter_step_bench.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <stdexcept>

#include "bench/record.h"
#include "models/cuda/drafter_gpu.h"
#include "models/drafter_config.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/dflash_attention.h"
#include "train/anchors.h"

namespace dflash {

namespace {

struct Preset {
  DrafterConfig cfg;
  int64_t V = 0, S = 0;
};

Preset preset(const std::string& name) {
  Preset p;
  DrafterConfig& c = p.cfg;
  c.num_hidden_layers = 5, c.block_size = 16, c.head_dim = 128, c.num_attention_heads = 32, c.num_key_value_heads = 8;
  if (name == "qwen3-8b") {  // ../shared/docs/anchors.md: d 4096, vocab 151936, S 3072
    c.hidden_size = 4096, c.intermediate_size = 12288, c.rope_theta = 1e6, c.num_target_layers = 36;
    p.V = 151936, p.S = 3072, c.mask_token_id = 151669;
  } else if (name == "qwen3.6-27b") {  // d 5120, vocab 248320, S 4096
    c.hidden_size = 5120, c.intermediate_size = 17408, c.rope_theta = 1e7, c.num_target_layers = 64;
    p.V = 248320, p.S = 4096, c.mask_token_id = 248070;
  } else if (name == "tiny") {  // smoke test of the command itself
    c.hidden_size = 256, c.intermediate_size = 512, c.num_attention_heads = 4, c.num_key_value_heads = 2;
    c.head_dim = 64, c.rope_theta = 1e6, c.num_target_layers = 8;
    p.V = 1000, p.S = 256, c.mask_token_id = 999;
  } else {
    throw std::invalid_argument("bench drafter-step: unknown preset '" + name + "' (qwen3-8b, qwen3.6-27b, tiny)");
  }
  c.vocab_size = p.V;
  c.target_layer_ids = default_target_layer_ids(c.num_target_layers, 5);
  c.layer_types.assign(size_t(c.num_hidden_layers), "full_attention");
  c.max_position_embeddings = 40960;
  return p;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// bf16 GEMM throughput (TFLOP/s) of cuBLASLt at 8192^3, median of 10 after 3 warm-ups.
double gemm_peak_tflops(cudaStream_t s) {
  const int64_t n = 8192;
  cuda::GemmContext g(s);
  cuda::DeviceArray<cuda::bf16> a(size_t(n * n)), b(size_t(n * n)), c(size_t(n * n));
  cuda::fill_normal(a.data(), n * n, 1, 0.f, 1.f, s);
  cuda::fill_normal(b.data(), n * n, 2, 0.f, 1.f, s);
  cudaEvent_t e0, e1;
  DFLASH_CUDA_CHECK(cudaEventCreate(&e0));
  DFLASH_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 13; ++i) {
    DFLASH_CUDA_CHECK(cudaEventRecord(e0, s));
    g.gemm({n, n, n, false, true}, a.data(), b.data(), c.data());
    DFLASH_CUDA_CHECK(cudaEventRecord(e1, s));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * double(n) * n * n / (median(t) * 1e-3) / 1e12;
}

/// Model FLOPs of one training step (the count anchors.md uses): every drafter GEMM forward +
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
  Preset p = preset(o.preset);
  if (o.seq > 0) p.S = o.seq;
  const DrafterConfig& c = p.cfg;
  const int64_t S = p.S, B = c.block_size;
  cuda::require_device("bench drafter-step");
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  // Keep freed stream-ordered memory in the pool between steps (no OS round trips).
  cudaMemPool_t pool;
  DFLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  uint64_t keep = UINT64_MAX;
  DFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  const double gemm_peak = gemm_peak_tflops(s);

  size_t free0 = 0, free1 = 0, total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  DrafterGpu gpu(c, p.V, 1234, s);
  cuda::DeviceArray<cuda::bf16> taps(size_t(S * int64_t(c.target_layer_ids.size()) * c.hidden_size));
  cuda::fill_normal(taps.data(), int64_t(taps.size()), 99, 0.f, 1.f, s);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
  uint64_t zero = 0;
  DFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));

  // A chat-like sequence: the first 10 % is prompt (no loss), the rest response.
  std::mt19937_64 rng(7);
  DrafterGpuSequence seq;
  seq.taps = taps.data();
  std::vector<uint8_t> mask(static_cast<size_t>(S));
  for (int64_t t = 0; t < S; ++t) {
    seq.ids.push_back(int64_t(rng() % uint64_t(c.mask_token_id)));
    mask[size_t(t)] = t >= S / 10;
    seq.loss_mask.push_back(mask[size_t(t)]);
  }
  seq.anchors = sample_anchors(mask, o.anchors, rng);
  seq.num_blocks = int64_t(seq.anchors.size());
  seq.gamma = 7.0;
  double visible = 0;
  for (const auto& r : cpu::dflash_kv_ranges(seq.anchors, seq.num_blocks, B, S, 0))
    visible += double(r.ctx_end - r.ctx_begin + r.blk_end - r.blk_begin);
  const int64_t Q = seq.num_blocks * B;

  std::vector<double> ms;
  double loss = 0;
  AdamWOptions ao;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    gpu.zero_grads();
    DrafterGpuStepOptions so;
    so.recompute = o.recompute;
    loss = gpu.step(seq, so).loss;
    gpu.optimizer_step(ao, 6e-4, 1.0, i + 1);  // synchronizes
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= o.warmup) ms.push_back(dt);
  }
  // One more step with per-stage GPU timings (where the time goes), and the optimizer alone.
  gpu.zero_grads();
  DrafterGpuStepOptions timed;
  timed.time_stages = true;
  timed.recompute = o.recompute;
  const DrafterGpuStepResult tr = gpu.step(seq, timed);
  const auto t0 = std::chrono::steady_clock::now();
  gpu.optimizer_step(ao, 6e-4, 1.0, o.warmup + o.steps + 1);
  const double opt_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::json stages = nlohmann::json::object();
  for (const auto& [name, v] : tr.stage_ms) stages[name] = v;
  stages["optimizer"] = opt_ms;
  uint64_t pool_high = 0;
  DFLASH_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &pool_high));
  const double peak_gb = (double(free0 - free1) + double(pool_high)) / 1e9;
  const double step_ms = median(ms);
  const double flops = step_flops(c, p.V, S, Q, visible);
  const double tflops = flops / (step_ms * 1e-3) / 1e12;
  const nlohmann::json extra = {{"S", S}, {"anchors", seq.num_blocks}, {"block_size", B}, {"layers", c.num_hidden_layers},
                                {"hidden", c.hidden_size}, {"vocab", p.V}, {"steps", o.steps}, {"warmup", o.warmup},
                                {"min_ms", *std::min_element(ms.begin(), ms.end())},
                                {"max_ms", *std::max_element(ms.begin(), ms.end())}, {"loss", loss},
                                {"model_tflop_per_step", flops / 1e12}, {"achieved_tflops", tflops},
                                {"gemm_peak_tflops_8192", gemm_peak}, {"recompute", o.recompute},
                                {"params", gpu.num_params()}, {"stage_ms", stages},
                                {"what", "zero_grads + forward + backward + clip + AdamW"}};
  for (const auto& [metric, value, unit] : {std::tuple<const char*, double, const char*>{"step_ms", step_ms, "ms"},
                                            {"peak_gb", peak_gb, "GB"}}) {
    BenchRecord r;
    r.bench = "drafter-step";
    r.preset = o.recompute ? o.preset + "+recompute" : o.preset;
    r.metric = metric;
    r.value = value;
    r.unit = unit;
    r.extra = extra;
    if (o.record) r = append_bench_record(o.results, r, true);
    fmt::print("{}\n", to_json(r).dump());
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

}  // namespace dflash
