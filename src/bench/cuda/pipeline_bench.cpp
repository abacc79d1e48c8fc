#include "bench/cuda/pipeline_bench.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "bench/cuda/bench_util.h"
#include "bench/presets.h"
#include "models/cuda/drafter_gpu.h"
#include "models/cuda/target_gpu.h"
#include "train/cuda/gpu_backend.h"
#include "train/cuda/memory_plan.h"
#include "train/trainer.h"
#include "common/clock.h"

namespace dflash {

namespace {
void record_pipeline(const PipelineBenchOptions& o, const std::string& preset, double samples_per_s, int64_t S,
                     double peak_gb, const nlohmann::json& extra) {
  emit_bench_records("pipeline", preset,
                     {{"samples_per_s", samples_per_s, "samples/s"}, {"tokens_per_s", samples_per_s * double(S), "tokens/s"},
                      {"peak_gb", peak_gb, "GB"}},
                     extra, o.results, o.record);
}

/// The preset as recorded: "-fp8" appended for an FP8 target.
std::string preset_name(const PipelineBenchOptions& o) {
  return o.preset + (o.target_dtype == TargetDtype::kFp8 ? "-fp8" : "");
}

std::string gpu_list(const std::vector<int>& g) {
  std::string r;
  for (size_t i = 0; i < g.size(); ++i) r += (i ? "," : "") + std::to_string(g[i]);
  return r;
}

/// The training path: DrafterTrainer over make_gpu_backend's replicas (random weights, the same on
/// every replica), the sample of bench_sequence repeated.
int run_training_path(const PipelineBenchOptions& o, const PipelineBenchPreset& p) {
  const DrafterConfig& c = p.drafter.cfg;
  const int64_t S = o.seq > 0 ? o.seq : p.drafter.S;
  const std::vector<int>& dg = o.drafter_gpus;
  const std::vector<int>& tg = o.target_gpus.empty() ? dg : o.target_gpus;
  for (const auto* l : {&tg, &dg})
    for (int g : *l) cuda::require_device("bench pipeline", g);
  DFLASH_CUDA_CHECK(cudaSetDevice(dg[0]));
  PeakMemory mem;  // (device 0 of the process: GPU 0 of the lists when they start there)
  GpuReplicaFactory f;
  f.target = [&](cudaStream_t s) { return std::make_unique<TargetGpu>(p.target, 4321, s, o.target_dtype); };
  f.drafter = [&](cudaStream_t s) { return std::make_unique<DrafterGpu>(c, p.drafter.V, 1234, s); };
  const DrafterGpuSequence seq = bench_sequence(c, S, o.anchors, nullptr);
  TrainSample sample;
  sample.ids = seq.ids;
  sample.loss_mask.assign(seq.loss_mask.begin(), seq.loss_mask.end());
  TrainerOptions to;
  to.num_anchors = o.anchors;
  to.grad_accum = int64_t(o.per_replica) * int64_t(dg.size());
  to.schedule = {6e-4, o.warmup + o.steps, 0.0};
  DrafterTrainer tr(c, make_gpu_backend(c, f, tg, dg, GpuTrainOptions{false, S, o.target_dtype, ProcessGroup{}}), 1000, to);
  mem.static_done(nullptr);
  std::vector<double> step_ms;
  double target_ms = 0, drafter_ms = 0, queue_ms = 0, optimizer_ms = 0, loss = 0;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const TrainStepStats st = tr.step([&](int64_t) { return sample; });
    if (i < o.warmup) continue;
    step_ms.push_back(ms_since(t0));
    target_ms += st.target_ms / double(tg.size()), drafter_ms += st.drafter_ms / double(dg.size());
    queue_ms += st.queue_ms / double(dg.size()), optimizer_ms += st.optimizer_ms, loss = st.loss;
  }
  const double n = double(o.steps), per_step = median(step_ms);
  const double samples_per_s = double(to.grad_accum) / (per_step * 1e-3);
  const nlohmann::json extra = {
      {"S", S}, {"anchors", seq.num_blocks}, {"block_size", c.block_size}, {"target_gpus", tg}, {"drafter_gpus", dg},
      {"samples_per_step", to.grad_accum}, {"step_ms", per_step}, {"steps", o.steps}, {"warmup", o.warmup},
      {"hidden", c.hidden_size}, {"vocab", p.drafter.V}, {"target_layers", p.target.num_hidden_layers},
      {"loss", loss},
      {"stage_ms_per_step_per_replica",
       {{"target_forward", target_ms / n}, {"queue_wait", queue_ms / n}, {"drafter", drafter_ms / n},
        {"optimizer_allreduce", optimizer_ms / n}}},
      {"what", "the dflash train path (DrafterTrainer + GPU backend): samples per optimizer step / median step wall "
               "time; stages: wall ms per step per replica; peak_gb: GPU " + std::to_string(dg[0])}};
  const std::string where = tg == dg ? "gpus=" + gpu_list(dg) : "target=" + gpu_list(tg) + ",drafter=" + gpu_list(dg);
  record_pipeline(o, preset_name(o) + "/" + where, samples_per_s, S, mem.peak_gb(), extra);
  return 0;
}

}  // namespace

int run_pipeline_bench(const PipelineBenchOptions& o) {
  const PipelineBenchPreset p = pipeline_bench_preset(o.preset);
  if (!o.drafter_gpus.empty() || !o.target_gpus.empty()) {
    if (o.drafter_gpus.empty())
      throw std::invalid_argument("bench pipeline: --target-gpus needs --drafter-gpus (or use --gpus)");
    return run_training_path(o, p);
  }
  const DrafterConfig& c = p.drafter.cfg;
  const int64_t S = o.seq > 0 ? o.seq : p.drafter.S, K = int64_t(c.target_layer_ids.size());
  cuda::require_device("bench pipeline");
  DrafterGpuSequence seq = bench_sequence(c, S, o.anchors, nullptr);  // (host only: the taps come below)
  const MemoryPlan plan = plan_memory(c, p.target, S, seq.num_blocks, false, S, 1, true, o.target_dtype);
  {  // what cannot fit is refused up front, as dflash train does, not found out of memory half-way
    int dev = 0;
    size_t free_b = 0, total_b = 0;
    DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
    DFLASH_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const std::string refusal = memory_refusal(plan, true, true, dev, double(free_b), "lower --anchors or --seq");
    if (!refusal.empty()) throw std::runtime_error("bench pipeline: " + refusal);
  }
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));

  PeakMemory mem;
  TargetGpu target(p.target, 4321, s, o.target_dtype);
  // The drafter's embed_tokens / lm_head are its own random ones, not the target's: DrafterGpu owns
  // its copy (sharing would need a DrafterGpu constructor over the target's device arrays). Same
  // shapes, so the same work; and dflash train's GPU backend holds two copies as well, so the peak
  // memory is that run's (2 x V x d bf16 more than one shared copy).
  DrafterGpu drafter(c, p.drafter.V, 1234, s);
  cuda::DeviceArray<cuda::bf16> taps(size_t(S * K * c.hidden_size));
  mem.static_done(s);

  seq.taps = taps.data();
  const std::vector<int32_t> ids(seq.ids.begin(), seq.ids.end());
  auto run_target = [&] { target.forward_taps(ids, {0, S}, c.target_layer_ids, taps.data()); };

  std::vector<double> target_ms, drafter_ms, sample_ms;
  double loss = 0;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run_target();
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
    const double tm = ms_since(t0);
    const auto t1 = std::chrono::steady_clock::now();
    loss = bench_train_step(drafter, seq, false, i + 1);
    const double dm = ms_since(t1);
    if (i < o.warmup) continue;
    target_ms.push_back(tm), drafter_ms.push_back(dm), sample_ms.push_back(tm + dm);
  }
  // One more sample with GPU timers per stage: the target's forward (CUDA events) and the drafter's
  // stage timers.
  const double target_gpu_ms = time_runs(s, 0, 1, run_target)[0];
  nlohmann::json stages = {{"target_forward", target_gpu_ms}};
  target.time_stages(true);  // and once more by stage (the events cost a little)
  run_target();
  for (const auto& [name, ms] : target.last_stage_ms()) stages["target_" + name] = ms;
  target.time_stages(false);
  const nlohmann::json drafter_stages = timed_train_step(drafter, seq, false, o.warmup + o.steps + 1);
  for (const auto& st : drafter_stages.items()) stages["drafter_" + st.key()] = st.value();
  const double peak_gb = mem.peak_gb();

  const double per_sample_ms = median(sample_ms);
  const double samples_per_s = 1e3 / per_sample_ms;
  const nlohmann::json extra = {
      {"S", S}, {"anchors", seq.num_blocks}, {"block_size", c.block_size}, {"target_layers", p.target.num_hidden_layers},
      {"target_layers_run", *std::max_element(c.target_layer_ids.begin(), c.target_layer_ids.end()) + 1},
      {"target_layer_ids", c.target_layer_ids}, {"hidden", c.hidden_size}, {"vocab", p.drafter.V},
      {"drafter_layers", c.num_hidden_layers}, {"drafter_params", drafter.num_params()}, {"steps", o.steps},
      {"warmup", o.warmup}, {"sample_ms", per_sample_ms},
      {"min_sample_ms", *std::min_element(sample_ms.begin(), sample_ms.end())},
      {"max_sample_ms", *std::max_element(sample_ms.begin(), sample_ms.end())}, {"target_ms", median(target_ms)},
      {"drafter_ms", median(drafter_ms)}, {"loss", loss}, {"stage_ms", stages}, {"peak_parts", mem.parts()},
      {"planned_gb", plan.on_gpu(true, true) / 1e9}, {"target_dtype", target_dtype_name(o.target_dtype)},
      {"what", "one sample: target forward_taps + drafter zero_grads + forward + backward + clip + AdamW, "
               "colocated on one GPU (wall time; stage_ms: GPU time of one more sample)"}};
  record_pipeline(o, preset_name(o), samples_per_s, S, peak_gb, extra);
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

}  // namespace dflash
