#include "bench/cuda/decode_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

#include "bench/cuda/bench_util.h"
#include "bench/presets.h"
#include "common/clock.h"
#include "models/cuda/target_gpu.h"

namespace dflash {

namespace {

/// Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB copy: the best of 5
/// after a warm-up.
double copy_bandwidth(cudaStream_t s) {
  const size_t n = size_t(1) << 30;
  cuda::DeviceArray<uint8_t> a(n), b(n);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(a.data(), 1, n, s));
  const std::vector<double> ms = time_runs(s, 1, 5, [&] {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), n, cudaMemcpyDeviceToDevice, s));
  });
  return 2.0 * double(n) / (*std::min_element(ms.begin(), ms.end()) * 1e-3);
}

/// Bytes of one sequence's cache at context length `ctx` that a decoding step reads: keys / values of
/// every attention layer (bf16) and, `state_passes` times, every GatedDeltaNet layer's fp32 state
/// (a step reads it and writes it back: 2; held: 1).
double sequence_bytes(const ModelSpec& s, double ctx, double state_passes) {
  double b = 0;
  for (int64_t i = 0; i < s.num_hidden_layers; ++i)
    b += s.layer_types[size_t(i)] == LayerKind::Attention
             ? ctx * double(s.num_key_value_heads * s.head_dim) * 2 * 2
             : state_passes * double(s.linear_num_value_heads * s.linear_key_head_dim * s.linear_value_head_dim) * 4;
  return b;
}

/// Bytes one decoding step of B sequences at context length `ctx` reads (and, for the recurrent
/// states, writes): see run_decode_bench.
double step_bytes(const ModelSpec& s, TargetDtype dtype, int64_t B, double ctx) {
  const double D = double(s.hidden_size), V = double(s.vocab_size);
  // the weights as stored, less embed_tokens (B rows gathered) and the GEMM workspace
  double w = double(TargetGpu::weight_bytes(s, dtype)) - 2 * V * D - double(32 << 20);
  for (int64_t i = 0; i < s.num_hidden_layers; ++i) {
    if (!s.is_moe_layer(i)) continue;
    const double E = double(s.num_experts), k = double(s.num_experts_per_tok), Em = double(s.moe_intermediate_size);
    const double experts = 2 * E * 3 * Em * D;                // bf16 gate | up, down
    const double share = 1 - std::pow(1 - k / E, double(B));  // expected share of the experts a step routes to
    w -= experts * (1 - share);
  }
  return w + double(B) * sequence_bytes(s, ctx, 2);
}

}  // namespace

int run_decode_bench(const DecodeBenchOptions& o) {
  const PipelineBenchPreset p = pipeline_bench_preset(o.preset);
  const ModelSpec& spec = p.target;
  cuda::require_device("bench decode");
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double bw = copy_bandwidth(s);
  cudaMemPool_t pool{};
  DFLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  size_t free0 = 0, total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  TargetGpu gpu(spec, 7, s, o.dtype);
  fmt::print("bench decode: {} ({}), {} layers, copy bandwidth {:.0f} GB/s\n", o.preset, target_dtype_name(o.dtype),
             spec.num_hidden_layers, bw / 1e9);
  std::mt19937 rng(99);
  const std::string preset = o.preset + (o.dtype == TargetDtype::kFp8 ? "-fp8" : "") + "-cuda";
  for (const int64_t B : o.batches) {
    // What the cache of B sequences at the last step holds: keys / values of P + new_tokens tokens,
    // the recurrent states and conv windows; a batch that cannot fit is skipped, saying so.
    // (the key / value capacity doubles as it grows; old and new buffers coexist while it is copied)
    double cap = 256;
    while (cap < double(o.prompt_tokens + o.new_tokens + 1)) cap *= 2;  // (+1: the step timed by stage)
    const double cache_b = double(B) * (sequence_bytes(spec, 1.5 * cap, 1));
    size_t free_now = 0;
    gpu.reset_cache(0);
    DFLASH_CUDA_CHECK(cudaMemGetInfo(&free_now, &total));
    if (cache_b > 0.9 * double(free_now)) {
      fmt::print("bench decode: batch {}: its cache (~{:.1f} GB) does not fit the {:.1f} GB free next to the weights; "
                 "skipped\n", B, cache_b / 1e9, double(free_now) / 1e9);
      continue;
    }
    uint64_t zero = 0;
    DFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
    gpu.reset_cache(int(B));
    const int64_t P = o.prompt_tokens;
    std::vector<int32_t> last(static_cast<size_t>(B));
    ForwardOptions fo;
    fo.logits = false;
    try {
      const auto t_prefill = std::chrono::steady_clock::now();
      const int64_t per_forward = std::max<int64_t>(1, 8192 / P);  // sequences prefilled together
      for (int64_t first = 0; first < B; first += per_forward) {
        std::vector<int32_t> ids, amax;
        std::vector<int64_t> cu{0};
        for (int64_t q = 0; q < B; ++q) {
          if (q >= first && q < first + per_forward)
            for (int64_t t = 0; t < P; ++t) ids.push_back(int32_t(rng() % uint32_t(spec.vocab_size)));
          cu.push_back(int64_t(ids.size()));
        }
        gpu.forward_cached(ids, cu, fo, &amax);
        for (int64_t q = first; q < std::min(B, first + per_forward); ++q) last[size_t(q)] = amax[size_t((q - first + 1) * P - 1)];
      }
      const double prefill_ms = ms_since(t_prefill);
      std::vector<int64_t> cu(size_t(B) + 1);
      for (int64_t q = 0; q <= B; ++q) cu[size_t(q)] = q;
      std::vector<int32_t> next;
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t step = 0; step < o.new_tokens; ++step) {
        gpu.forward_cached(last, cu, fo, &next);
        last.swap(next);
      }
      const double decode_s = ms_since(t0) * 1e-3;
      size_t free1 = 0;
      DFLASH_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
      uint64_t pool_high = 0, pool_now = 0;
      DFLASH_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &pool_high));
      DFLASH_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &pool_now));
      const double memory_gb = (double(free0) - double(free1) - double(pool_now) + double(pool_high)) / 1e9;
      gpu.time_stages(true);  // one more step with CUDA events around its stages: where a step's time goes
      gpu.forward_cached(last, cu, fo, &next);
      const nlohmann::json stages = stage_json(gpu.last_stage_ms());
      gpu.time_stages(false);
      const double tps = double(B * o.new_tokens) / decode_s;
      const double bytes = step_bytes(spec, o.dtype, B, double(P) + double(o.new_tokens) / 2);
      const double bound = double(B) / (bytes / bw);
      const nlohmann::json extra = {
          {"batch", B}, {"prompt_tokens", P}, {"new_tokens", o.new_tokens}, {"target_dtype", target_dtype_name(o.dtype)},
          {"decode_s", decode_s}, {"prefill_ms", prefill_ms}, {"step_ms", decode_s * 1e3 / double(o.new_tokens)},
          {"step_bytes_gb", bytes / 1e9}, {"copy_bandwidth_gb_s", bw / 1e9}, {"tokens_per_s_bandwidth_bound", bound},
          {"of_bandwidth_bound", tps / bound}, {"memory_gb", memory_gb}, {"stage_ms", stages},
          {"what", "TargetGpu::forward_cached, one token per sequence per step, greedy argmax on the GPU, random weights; "
                   "bound: the bytes a step reads (weights touched, KV at the mean context, recurrent states) over the "
                   "measured copy bandwidth"}};
      emit_bench_records("decode", preset + "-b" + std::to_string(B),
                         {{"tokens_per_s", tps, "tokens/s"}, {"of_bandwidth_bound", tps / bound, ""}}, extra, o.results,
                         o.record);
    } catch (const std::runtime_error& e) {  // this batch's cache and buffers do not fit (cuda::check_alloc's message)
      if (std::string(e.what()).rfind("out of GPU memory", 0) != 0) throw;
      gpu.time_stages(false);
      gpu.reset_cache(0);
      fmt::print("bench decode: batch {}: skipped: {}\n", B, e.what());
    }
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

}  // namespace dflash
