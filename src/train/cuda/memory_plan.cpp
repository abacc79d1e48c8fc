#include "train/cuda/memory_plan.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "gpu/runtime.h"
#include "models/cuda/drafter_gpu.h"
#include "models/cuda/target_gpu.h"
#include "train/gpu.h"

namespace dflash {

MemoryPlan plan_memory(const DrafterConfig& dc, const ModelSpec& ts, int64_t S, int64_t anchors, bool recompute,
                       int64_t pack_tokens, int64_t pack_sequences, bool take_turns, TargetDtype target_dtype) {
  MemoryPlan p;
  // The captured layers (DSpark adds the target's final hidden states, from its last layer).
  const std::vector<int64_t> cap = captured_layer_ids(dc);
  const int64_t T = std::max(S, pack_tokens), K = int64_t(cap.size());
  const int64_t last = *std::max_element(cap.begin(), cap.end());
  p.target_weights = double(TargetGpu::weight_bytes(ts, target_dtype));
  p.target_forward =
      double(TargetGpu::forward_taps_bytes(ts, T, std::max<int64_t>(1, pack_sequences), last, target_dtype));
  p.drafter_state = double(DrafterGpu::state_bytes(dc, ts.vocab_size));
  p.drafter_step = double(DrafterGpu::step_bytes(dc, ts.vocab_size, S, anchors, recompute));
  p.taps = 2.0 * double(T * K * dc.hidden_size);
  p.sample_taps = 2.0 * double(S * K * dc.hidden_size);
  p.taps_in_flight = take_turns ? 1 : 3;
  p.take_turns = take_turns;
  return p;
}

double pool_reserved(double bytes) {
  constexpr double kGranule = double(int64_t(32) << 20);
  return std::ceil(bytes / kGranule) * kGranule;
}

double MemoryPlan::on_gpu(bool target_here, bool drafter_here) const {
  // (The taps come from the pool too; a run's own buffers are what it adds up.)
  const double packs = taps * double(taps_in_flight);
  if (target_here && drafter_here)
    return target_weights + drafter_state +
           pool_reserved(packs + (take_turns ? std::max(target_forward, drafter_step) : target_forward + drafter_step));
  if (target_here) return target_weights + pool_reserved(target_forward + packs);
  return drafter_here ? drafter_state + pool_reserved(drafter_step + sample_taps) : 0;
}

std::string memory_refusal(const MemoryPlan& p, bool target_here, bool drafter_here, int gpu, double free_b,
                           const std::string& shrink) {
  const double need_b = p.on_gpu(target_here, drafter_here);
  if (!(free_b > 0) || need_b <= 0.95 * free_b) return "";
  std::string knob;
  if (target_here && drafter_here && p.target_weights + p.drafter_state > 0.95 * free_b)
    knob = "the target and the drafter's state alone do not fit one GPU together: put them on separate GPUs "
           "(--target-gpus / --drafter-gpus, e.g. --target-gpus 0 --drafter-gpus 1) or use a GPU with more memory";
  else if (drafter_here)
    knob = shrink + " (the activations scale with them)" +
           (target_here ? ", put the target and the drafter on separate GPUs (--target-gpus / --drafter-gpus)" : "") +
           ", or use a GPU with more memory";
  else
    knob = "the target does not fit: use a GPU with more memory";
  return fmt::format("this run needs about {:.1f} GB on cuda:{}, more than the {:.1f} GB usable there (95 % of "
                     "{:.1f} GB free): {}",
                     need_b / 1e9, gpu, 0.95 * free_b / 1e9, free_b / 1e9, knob);
}

void check_gpu_memory(const TrainConfig& c, const DrafterConfig& dc, const ModelSpec& target, int64_t longest,
                      int64_t shortest, int world) {
  // One GPU for both, one process: the target's forward and the drafter's steps take turns there.
  const bool one_gpu = c.target_devices() == c.drafter_devices() && c.drafter_devices().size() == 1 && world == 1;
  const MemoryPlan mp = plan_memory(dc, target, longest, c.num_anchors, c.recompute, c.target_batch_tokens,
                                    c.target_batch_tokens / std::max<int64_t>(1, shortest) + 1, one_gpu,
                                    parse_target_dtype(c.target_dtype));
  // Each GPU holds a target replica, a drafter replica, or both (colocated).
  std::vector<int> all = c.target_devices();
  for (int g : c.drafter_devices())
    if (std::find(all.begin(), all.end(), g) == all.end()) all.push_back(g);
  for (int g : all) {
    const auto has = [g](const std::vector<int>& l) { return std::find(l.begin(), l.end(), g) != l.end(); };
    const bool tg = has(c.target_devices()), dg = has(c.drafter_devices());
    const double need_b = mp.on_gpu(tg, dg);
    size_t fb = 0, tb = 0;
    DFLASH_CUDA_CHECK(cudaSetDevice(g));
    DFLASH_CUDA_CHECK(cudaMemGetInfo(&fb, &tb));
    const std::string have = fmt::format("{:.1f} GB free of {:.1f} GB", double(fb) / 1e9, double(tb) / 1e9);
    std::string parts;
    if (tg) parts += fmt::format("target ({}) {:.1f} GB + its forward {:.1f} GB | ", c.target_dtype,
                                 mp.target_weights / 1e9, mp.target_forward / 1e9);
    if (dg) parts += fmt::format("drafter state {:.1f} GB + its step {:.1f} GB (longest sample {}, {} anchors x {}) | ",
                                 mp.drafter_state / 1e9, mp.drafter_step / 1e9, longest, c.num_anchors, dc.block_size);
    fmt::print("train: memory plan (cuda:{}, {}): {}total ~{:.1f} GB\n", g, have, parts, need_b / 1e9);
    const std::string refusal = memory_refusal(mp, tg, dg, g, double(fb), "lower --num-anchors or --max-length");
    if (!refusal.empty()) throw std::runtime_error(refusal);
  }
}

}  // namespace dflash
