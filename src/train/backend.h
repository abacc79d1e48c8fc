// The device side of drafter training, behind one interface so that the training loop (data order,
// anchors, accumulation, schedule, checkpoints: src/train/trainer.h) is the same on the CPU reference
// and on GPUs. A backend owns the drafter's parameters, gradients and AdamW moments and computes the
// target's taps for a sample itself (CPU: TargetModel; GPU: TargetGpu on the device).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/drafter.h"
#include "train/tap_check.h"
#include "ops/optimizer.h"

namespace dflash {

/// One training sample of the data: token ids and the loss mask (1 on assistant tokens).
struct TrainSample {
  int64_t index = -1;              // position in the data set
  std::vector<int64_t> ids;        // [S]
  std::vector<uint8_t> loss_mask;  // [S]
};

/// What one micro-batch (one sequence) gave.
struct MicroResult {
  double loss = 0, weight_sum = 0;                // as DrafterStepResult
  std::vector<int64_t> slot_correct, slot_count;  // [B]
  double target_ms = 0, drafter_ms = 0;           // wall time of the target forward and the drafter step
  double queue_ms = 0;                            // the drafter replica waiting for these taps
  bool nonfinite_taps = false;                    // the target's taps held NaN / Inf (backends that check)
  /// The captured layers' numbers (tap_check.h), for the first kTapCheckedMicroBatches micro-batches
  /// a backend (or each of its drafter replicas) runs; empty after those.
  std::vector<TapStats> tap_stats;
};

/// Micro-batches whose taps each backend (each drafter replica) checks at the start of a run.
inline constexpr int kTapCheckedMicroBatches = 4;

/// The AdamW state of a backend, parameters in DrafterWeights::named() order.
struct OptimizerState {
  int64_t step = 0;
  DrafterWeights<float> weights;                  // fp32 masters
  std::vector<std::vector<float>> exp_avg, exp_avg_sq;
};

/// One micro-batch of an optimizer step: a sample and its anchors.
struct MicroBatch {
  const TrainSample* sample = nullptr;
  std::vector<int64_t> anchors;
};

class DrafterBackend {
 public:
  virtual ~DrafterBackend() = default;
  virtual void zero_grads() = 0;
  /// Taps of `s` from the target, then the drafter's forward + backward with these anchors; the
  /// gradients are ADDED to the accumulated ones. Throws std::invalid_argument for a bad sample.
  virtual MicroResult micro_step(const TrainSample& s, const std::vector<int64_t>& anchors, const LossWeighting& loss) = 0;
  /// micro_step over all of `mbs` (results in the same order); a backend with several replicas runs
  /// them in parallel (their gradients are summed by optimizer_step). Errors are rethrown as
  /// std::runtime_error("training example N: ...") for the first failing micro-batch.
  virtual std::vector<MicroResult> micro_steps(const std::vector<MicroBatch>& mbs, const LossWeighting& loss) {
    std::vector<MicroResult> r;
    for (const MicroBatch& mb : mbs) {
      try {
        r.push_back(micro_step(*mb.sample, mb.anchors, loss));
      } catch (const std::exception& e) {
        throw std::runtime_error("training example " + std::to_string(mb.sample->index) + ": " + e.what());
      }
    }
    return r;
  }
  /// Whether `local` holds in any process of a multi-process run (every process must call it at
  /// the same point: the stop decision); a single process returns `local`.
  virtual bool any_rank(bool local) { return local; }
  /// Accumulated gradients *= f.
  virtual void scale_grads(double f) = 0;
  /// clip_grad_norm(max_norm) then AdamW step number `t` (1-based) at `lr`. A non-finite norm leaves
  /// weights and moments untouched (norm returned as is, coef NaN).
  virtual ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) = 0;
  virtual OptimizerState state() const = 0;
  /// Name of the first parameter whose accumulated gradient holds NaN / Inf ("" when none): what a
  /// skipped step reports. May be slow (a GPU backend downloads the gradients); for error paths.
  virtual std::string first_nonfinite_grad() const = 0;
  /// Replaces weights and moments (resume). Throws std::invalid_argument on shape mismatches.
  virtual void set_state(const OptimizerState& s) = 0;
  /// "cpu" or "cuda:N", for logs.
  virtual std::string device() const = 0;
};

/// Name of the first tensor of `w` holding NaN / Inf, or "".
std::string first_nonfinite(const DrafterWeights<float>& w);

/// Host taps [S, K*d] float32 of a sample, in target_layer_ids order (captured_layer_ids: a DSpark
/// drafter's rows end with the target's final hidden state, [S, (K + 1) d]).
using TapsFn = std::function<Tensor(const TrainSample&)>;

/// The CPU reference backend: drafter_step in fp32, AdamW<float>. `embed` and `lm_head` [V, d] must
/// outlive it. Throws std::invalid_argument when `weights` do not match `cfg`.
std::unique_ptr<DrafterBackend> make_cpu_backend(const DrafterConfig& cfg, DrafterWeights<float> weights,
                                                 const Tensor* embed, const Tensor* lm_head, TapsFn taps);

}  // namespace dflash
