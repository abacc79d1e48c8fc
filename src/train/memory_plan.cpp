#include "train/memory_plan.h"

#include <fmt/core.h>

#include <algorithm>

#include "models/drafter.h"
#include "tensor/tensor.h"

namespace dflash {

MemoryPlan plan_memory(const DrafterConfig& dc, const ModelSpec& ts, int64_t S, int64_t anchors, bool recompute,
                       int64_t pack_tokens) {
  MemoryPlan p;
  double n = 0;
  for (const auto& [name, shape] : drafter_param_shapes(dc)) n += double(BasicTensor<float>::numel_of(shape));
  const double d = double(dc.hidden_size), V = double(ts.vocab_size);
  p.drafter_state = n * (4 + 2 + 4 + 4 + 4) + 2 * V * d * 2;  // masters, bf16 copy, grads, m, v; embed + lm_head
  const double tl = double(ts.hidden_size) * double(ts.num_attention_heads + 2 * ts.num_key_value_heads) *
                        double(ts.head_dim) +
                    double(ts.num_attention_heads * ts.head_dim * ts.hidden_size) +
                    3.0 * double(ts.hidden_size) * double(ts.intermediate_size);
  p.target = 2.0 * (tl * double(ts.num_hidden_layers) + 2 * V * double(ts.hidden_size));
  // one packed forward's activations (fp32 residual, bf16 q/k/v/o, MLP) and its taps, twice (queued)
  const double T = double(std::max(S, pack_tokens)), Dt = double(ts.hidden_size);
  p.target += T * (4 * Dt + 2 * (Dt + 2 * double((ts.num_attention_heads + ts.num_key_value_heads) * ts.head_dim)) +
                   4 * double(ts.intermediate_size)) +
              2 * T * double(dc.target_layer_ids.size()) * double(dc.hidden_size) * 2;
  const double Q = double(anchors * dc.block_size), SQ = double(S) + Q, hq = double(dc.num_attention_heads * dc.head_dim),
               hk = double(dc.num_key_value_heads * dc.head_dim), I = double(dc.intermediate_size);
  const double per_layer = 2.0 * (Q * (3 * d + 3 * hq + 3 * I) + SQ * (d + 3 * hk));  // saved bf16 activations
  // with recompute: the layer inputs of all layers plus one layer's activations at a time
  p.activations = (recompute ? 2.0 * Q * d * double(dc.num_hidden_layers) + per_layer
                             : per_layer * double(dc.num_hidden_layers)) +
                  2.0 * 2.0 * Q * I +                                             // + backward temporaries
                  double(S) * double(dc.target_layer_ids.size()) * d * 2;        // taps
  p.cross_entropy = 1.5 * double(int64_t(1) << 30) + Q * d * 2;
  return p;
}

double MemoryPlan::on_gpu(bool target_here, bool drafter_here) const {
  return (target_here ? target : 0) + (drafter_here ? drafter_state + activations + cross_entropy : 0);
}

std::string memory_refusal(const MemoryPlan& p, bool target_here, bool drafter_here, int gpu, double free_b,
                           const std::string& shrink) {
  const double need_b = p.on_gpu(target_here, drafter_here);
  if (!(free_b > 0) || need_b <= 0.95 * free_b) return "";
  std::string knob;
  if (target_here && drafter_here && p.target + p.drafter_state > 0.95 * free_b)
    knob = "the target and the drafter's state alone do not fit one GPU together: put them on separate GPUs "
           "(--target-gpus / --drafter-gpus, e.g. --target-gpus 0 --drafter-gpus 1) or use a GPU with more memory";
  else if (drafter_here)
    knob = shrink + " (the activations scale with them)" +
           (target_here ? ", put the target and the drafter on separate GPUs (--target-gpus / --drafter-gpus)" : "") +
           ", or use a GPU with more memory";
  else
    knob = "the target does not fit: use a GPU with more memory";
  return fmt::format("this run needs about {:.1f} GB on cuda:{} but {:.1f} GB are free: {}", need_b / 1e9, gpu,
                     free_b / 1e9, knob);
}

}  // namespace dflash
