#include "bench/cuda/forward_bench.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "bench/cuda/bench_util.h"
#include "bench/presets.h"
#include "models/cuda/target_gpu.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gated_delta_rule.h"

namespace dflash {

namespace {
/// GEMM FLOPs of a forward of T tokens (one sequence): every projection, causal attention over the
/// visible keys, and the LM head when `lm_head`. The recurrence and elementwise work are not counted.
double forward_flops(const ModelSpec& s, int64_t T, int64_t layers, bool lm_head) {
  const double t = double(T), D = double(s.hidden_size), I = double(s.intermediate_size);
  const double H = double(s.num_attention_heads), Hkv = double(s.num_key_value_heads), Dh = double(s.head_dim);
  const double Hk = double(s.linear_num_key_heads), Hv = double(s.linear_num_value_heads);
  const double dk = double(s.linear_key_head_dim), dv = double(s.linear_value_head_dim);
  double f = 0;
  for (int64_t i = 0; i < layers; ++i) {
    if (s.is_moe_layer(i))  // router (+ shared gate), the k experts each token visits, the shared expert
      f += 2 * t * D * (double(s.num_experts) + 1 + 3 * double(s.num_experts_per_tok * s.moe_intermediate_size) +
                        3 * double(s.shared_expert_intermediate_size));
    else
      f += 2 * t * 3 * D * I;  // MLP
    if (s.layer_types[size_t(i)] == LayerKind::GatedDeltaNet)
      f += 2 * t * D * ((2 * Hk * dk + Hv * dv) + Hv * dv + 2 * Hv + Hv * dv);
    else
      f += 2 * t * D * (H * Dh * (s.attn_output_gate() ? 2 : 1) + 2 * Hkv * Dh + H * Dh) + 2 * 2 * H * Dh * t * t / 2;
  }
  return f + (lm_head ? 2 * t * D * double(s.vocab_size) : 0.0);
}

/// ||got - want|| / ||want|| over all elements (double sums).
double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    num += d * d, den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num / den);
}

/// ||o - o_ref|| / ||o_ref|| of the chunked output o against the token-by-token fp32 kernel
/// (gated_delta_rule_recurrent) on the same inputs: the precision the speed was bought with.
double rel_l2_vs_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                           const std::vector<int64_t>& cu, int Hk, int Hv, int dk, int dv, const float* o,
                           cudaStream_t s) {
  const int64_t T = cu.back(), n = int64_t(cu.size()) - 1;
  cuda::DeviceArray<float> state(size_t(n * Hv * dk * dv)), ref(size_t(T * Hv * dv));
  DFLASH_CUDA_CHECK(cudaMemsetAsync(state.data(), 0, state.size() * sizeof(float), s));
  cuda::gated_delta_rule_recurrent(q, k, v, g, beta, cu, Hk, Hv, dk, dv, state.data(), nullptr, ref.data(), s);
  std::vector<float> got(ref.size());
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(got.data(), o, got.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
  return rel_l2(got, ref.to_host(s));
}

/// The FP8 target against the bf16 one with the same random weights (seed 7) on `tokens` random
/// tokens (one sequence): rel_l2 of the logits, of each tap's hidden states and of all taps together
/// (what the drafter trains on). The two are built one after the other: the 27B pair does not fit one
/// 80 GB GPU at once.
nlohmann::json fp8_vs_bf16(const ModelSpec& spec, const std::vector<int64_t>& taps, int64_t tokens, cudaStream_t s) {
  // The timed runs' pooled activations go back to the device first (PeakMemory keeps freed memory
  // in the pool): the bf16 target needs the room.
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  int device = 0;
  cudaMemPool_t pool;
  DFLASH_CUDA_CHECK(cudaGetDevice(&device));
  DFLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  DFLASH_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
  std::mt19937 rng(99);
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (auto& t : ids) t = int32_t(rng() % uint32_t(spec.vocab_size));
  ForwardOptions fo;  // logits and hidden_states[tap + 1], on the host as float32
  for (int64_t id : taps) fo.hidden_states.push_back(int(id + 1));
  auto run = [&](TargetDtype dtype) { return TargetGpu(spec, 7, s, dtype).forward(ids, {0, tokens}, fo); };
  const ForwardOutput want = run(TargetDtype::kBf16), got = run(TargetDtype::kFp8);
  nlohmann::json per_tap = nlohmann::json::object();
  std::vector<float> all_got, all_want;
  for (int j : fo.hidden_states) {
    const std::vector<float>&a = got.hidden_states.at(j).data, &b = want.hidden_states.at(j).data;
    per_tap[std::to_string(j - 1)] = rel_l2(a, b);
    all_got.insert(all_got.end(), a.begin(), a.end()), all_want.insert(all_want.end(), b.begin(), b.end());
  }
  return {{"tokens", tokens}, {"logits", rel_l2(got.logits.data, want.logits.data)}, {"taps", rel_l2(all_got, all_want)},
          {"per_tap", per_tap}};
}
}  // namespace

int run_gdn_bench(const GdnBenchOptions& o) {
  cuda::require_device("bench gdn");
  const PeakMemory pool_keeps_memory;  // as in a forward: temporaries reuse the pool, no OS round trips
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int Hk = 16, Hv = 48, dk = 128, dv = 128;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes{
      {"t4096", {4096}}, {"t16384", {16384}}, {"packed8x512", std::vector<int64_t>(8, 512)}};
  for (const auto& [name, lens] : shapes) {
    std::vector<int64_t> cu{0};
    for (int64_t n : lens) cu.push_back(cu.back() + n);
    const int64_t T = cu.back(), C = 2 * Hk * dk + Hv * dv, Nin = C + Hv * dv + 2 * Hv;
    // Inputs as a GatedDeltaNet layer makes them: in_proj's bf16 output (q | k | v | z | b | a), the
    // conv, then prepared.
    cuda::DeviceArray<cuda::bf16> pre(size_t(T * Nin));
    cuda::DeviceArray<float> conv(size_t(T * C)), q(size_t(T * Hk * dk)), k(size_t(T * Hk * dk)),
        v(size_t(T * Hv * dv)), out(size_t(T * Hv * dv)), w(size_t(C * 4)), A_log{size_t(Hv)}, dt{size_t(Hv)},
        g(size_t(T * Hv)), beta(size_t(T * Hv));
    cuda::fill_normal(pre.data(), T * Nin, 1, 0.f, 1.f, s);
    const cuda::bf16 *b = pre.data() + C + Hv * dv, *a = b + Hv;
    cuda::fill_normal(w.data(), C * 4, 2, 0.f, 0.3f, s);
    cuda::fill_normal(A_log.data(), Hv, 5, 0.f, 0.5f, s);
    cuda::fill_normal(dt.data(), Hv, 6, 0.f, 0.f, s);
    auto starts = cuda::upload(cuda::sequence_starts(cu), s);
    const float scale = 1.f / std::sqrt(float(dk));
    auto conv_run = [&] {
      cuda::causal_conv1d_silu(pre.data(), Nin, w.data(), starts.data(), T, C, 4, conv.data(), s);
    };
    auto prep_run = [&] {
      cuda::gdn_prepare(conv.data(), b, a, Nin, A_log.data(), dt.data(), T, Hk, Hv, dk, dv, scale, q.data(), k.data(),
                        v.data(), g.data(), beta.data(), s);
    };
    const cuda::GdnChunkPlan plan(cu, s);  // made once per batch, as a forward does
    auto rule_run = [&] {
      cuda::gated_delta_rule_chunked(q.data(), k.data(), v.data(), g.data(), beta.data(), plan, Hk, Hv, dk, dv, nullptr,
                                     nullptr, out.data(), s);
    };
    // The path a target forward without a cache runs: the conv1d, l2norm and gates inside the chunk
    // preparation (from in_proj's bf16 output), the gated RMSNorm applied to the output rows.
    cuda::DeviceArray<float> gnorm_w{size_t(dv)};
    cuda::DeviceArray<cuda::bf16> normed(size_t(T * Hv * dv));
    cuda::fill_normal(gnorm_w.data(), dv, 7, 1.f, 0.1f, s);
    const cuda::GdnProjections from{pre.data(), Nin, w.data(), 4, b, a, Nin, A_log.data(), dt.data(), scale,
                                    starts.data()};
    const cuda::GatedNormOut norm{pre.data() + C, Nin, gnorm_w.data(), 1e-6f, normed.data()};
    auto layer_run = [&] {
      cuda::gated_delta_rule_chunked(nullptr, nullptr, nullptr, nullptr, nullptr, plan, Hk, Hv, dk, dv, nullptr, nullptr,
                                     nullptr, s, 0, 0, &norm, &from);
    };
    const double conv_ms = median(time_runs(s, o.warmup, o.steps, conv_run));
    const double prep_ms = median(time_runs(s, o.warmup, o.steps, prep_run));
    const double rule_ms = median(time_runs(s, o.warmup, o.steps, rule_run));
    const double layer_ms = median(time_runs(s, o.warmup, o.steps, layer_run));
    const double err = rel_l2_vs_recurrent(q.data(), k.data(), v.data(), g.data(), beta.data(), cu, Hk, Hv, dk, dv,
                                           out.data(), s);
    const nlohmann::json extra = {{"T", T}, {"sequences", lens.size()}, {"Hk", Hk}, {"Hv", Hv}, {"dk", dk}, {"dv", dv},
                                  {"chunk", 64}, {"conv1d_ms", conv_ms}, {"prepare_ms", prep_ms},
                                  {"forward_path_ms", layer_ms},
                                  {"forward_path_fused", cuda::gdn_projections_fuse(from, dk)},
                                  {"rel_l2_vs_recurrent", err},
                                  {"what", "gated_delta_rule_chunked forward (q, k normalized; gates given), CUDA events; "
                                           "forward_path_ms: from in_proj's bf16 output with the conv1d, l2norm and "
                                           "gates inside and the gated RMSNorm applied, as a target forward runs it"}};
    emit_bench_records("gdn", name, {{"ms", rule_ms, "ms"}}, extra, o.results, o.record);
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

int run_target_forward_gpu_bench(const TargetForwardGpuOptions& o) {
  PipelineBenchPreset p = pipeline_bench_preset(o.preset);
  ModelSpec spec = p.target;
  if (o.layers > 0 && o.layers < spec.num_hidden_layers) {
    spec.num_hidden_layers = o.layers;
    spec.layer_types.resize(size_t(o.layers));
  }
  const int64_t T = o.tokens, L = spec.num_hidden_layers;
  std::vector<int64_t> taps;
  for (int64_t id : p.drafter.cfg.target_layer_ids)
    if (id < L) taps.push_back(id);
  if (taps.empty()) taps.push_back(L - 1);
  cuda::require_device("bench target-forward");
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double gemm_peak = gemm_peak_tflops(s);
  PeakMemory mem;
  double with_head_ms = 0, taps_ms = 0, peak_gb = 0;
  std::vector<double> head_runs, taps_runs;  // ms of each timed forward
  nlohmann::json stages, taps_stages;
  PowerSummary power;
  std::vector<cuda::GemmCall> calls;  // the products of one forward with the LM head
  bool tuned = false;
  {
    TargetGpu gpu(spec, 7, s, o.dtype);
    cuda::DeviceArray<cuda::bf16> tap_out(size_t(T * int64_t(taps.size()) * spec.hidden_size));
    mem.static_done(s);
    std::mt19937 rng(1234);
    std::vector<int32_t> ids(static_cast<size_t>(T)), amax;
    for (auto& t : ids) t = int32_t(rng() % uint32_t(spec.vocab_size));
    ForwardOptions fo;
    fo.logits = false;
    {  // the GPU's clock and power during the timed forwards (the sampler starts before the warm-up)
      const auto sampler = sample_current_gpu();
      time_runs(s, o.warmup, 0, [&] { gpu.forward(ids, {0, T}, fo, &amax); });
      sampler->take();
      head_runs = time_runs(s, 0, o.repeat, [&] { gpu.forward(ids, {0, T}, fo, &amax); });
      power = sampler->take()[0];
    }
    taps_runs = time_runs(s, o.warmup, o.repeat, [&] { gpu.forward_taps(ids, {0, T}, taps, tap_out.data()); });
    with_head_ms = median(head_runs), taps_ms = median(taps_runs);
    peak_gb = mem.peak_gb();
    // One more of each with CUDA events around the stages (where the time goes).
    gpu.time_stages(true);
    gpu.forward(ids, {0, T}, fo, &amax);
    stages = stage_json(gpu.last_stage_ms());
    gpu.forward_taps(ids, {0, T}, taps, tap_out.data());
    taps_stages = stage_json(gpu.last_stage_ms());
    gpu.time_stages(false);
    gpu.gemm().record_calls(&calls);
    gpu.forward(ids, {0, T}, fo, &amax);
    gpu.gemm().record_calls(nullptr);
    tuned = gpu.gemm().tunes_by_default();
  }
  // Those products alone, each back to back at the sustained (power-capped) clock: the forward's time
  // with every other kernel at zero time (an estimate: between lower-power kernels the clock recovers).
  const SustainedGemms sg = sustained_gemms(calls, tuned, s);
  const nlohmann::json accuracy =
      o.dtype == TargetDtype::kFp8 ? fp8_vs_bf16(spec, taps, o.accuracy_tokens, s) : nlohmann::json();
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
  const int64_t deepest = *std::max_element(taps.begin(), taps.end()) + 1;
  const double tf_head = forward_flops(spec, T, L, true) / (with_head_ms * 1e-3) / 1e12;
  const double tf_taps = forward_flops(spec, T, deepest, false) / (taps_ms * 1e-3) / 1e12;
  const int64_t gdn = std::count(spec.layer_types.begin(), spec.layer_types.end(), LayerKind::GatedDeltaNet);
  auto range = [](const std::vector<double>& v) {  // [fastest, slowest]
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    return nlohmann::json::array({*lo, *hi});
  };
  nlohmann::json extra = {
      {"tokens", T}, {"layers", L}, {"gated_deltanet_layers", gdn}, {"taps", taps}, {"layers_run_for_taps", deepest},
      {"forward_ms", with_head_ms}, {"taps_ms", taps_ms}, {"repeat", o.repeat},
      {"forward_ms_range", range(head_runs)}, {"taps_ms_range", range(taps_runs)},
      {"gemm_tflops_achieved", tf_head},
      {"gemm_peak_tflops_8192", gemm_peak}, {"of_gemm_peak", tf_head / gemm_peak}, {"taps_of_gemm_peak", tf_taps / gemm_peak},
      {"gemm_sustained_ms", sg.ms}, {"gemm_sustained_tflop", sg.tflop}, {"gemm_sustained_shapes", sg.shapes},
      {"peak_gb", peak_gb}, {"device_kind", "cuda"}, {"stage_ms", stages}, {"taps_stage_ms", taps_stages},
      {"power", power_json(power)},
      {"target_dtype", target_dtype_name(o.dtype)},
      {"path", std::string("TargetGpu ") + target_dtype_name(o.dtype) +
                   ": cuBLASLt GEMMs, masked_attention_forward, gated_delta_rule_chunked; random weights"}};
  // A bound from the products only where they are all of the model's (no experts: those run grouped
  // GEMMs outside cuBLASLt).
  if (spec.num_experts == 0 && sg.ms > 0) extra["tokens_per_s_gemm_bound"] = double(T) / (sg.ms * 1e-3);
  if (!accuracy.is_null()) {
    extra["fp8_vs_bf16_rel_l2"] = accuracy;
    fmt::print("bench target-forward: fp8 vs bf16 on {} tokens: rel L2 taps {:.3e}, logits {:.3e}\n",
               o.accuracy_tokens, accuracy["taps"].get<double>(), accuracy["logits"].get<double>());
  }
  fmt::print("bench target-forward: the GPU during the timed forwards: {}\n", power.words());
  const std::string preset = o.preset + (o.layers > 0 ? "-" + std::to_string(L) + "layers" : "") +
                             (o.dtype == TargetDtype::kFp8 ? "-fp8" : "") + "-cuda";
  emit_bench_records("target-forward", preset,
                     {{"tokens_per_s", double(T) / (with_head_ms * 1e-3), "tokens/s"},
                      {"tokens_per_s_taps", double(T) / (taps_ms * 1e-3), "tokens/s"}},
                     extra, o.results, o.record);
  return 0;
}

}  // namespace dflash
