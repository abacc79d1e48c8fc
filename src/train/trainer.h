// The drafter training loop: data order, anchors, gradient accumulation, clipping, schedule, AdamW
// (through a DrafterBackend), and checkpoints with a training state for exact resume
// (docs/dflash.md "Training").
#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "models/drafter.h"
#include "train/backend.h"
#include "ops/optimizer.h"
#include "train/schedule.h"

namespace dflash {

/// Supplies sample `index`, 0 <= index < num_examples. Must return the same sample for the same
/// index every time (resume relies on it).
using SampleSource = std::function<TrainSample(int64_t index)>;

/// Hyper-parameters. Defaults: the published recipe (dflash.md step 6) with gamma 7 for B = 16.
struct TrainerOptions {
  int64_t num_anchors = 512;      // anchors per sequence (fewer when the sequence has fewer candidates)
  int64_t grad_accum = 1;         // sequences (micro-batches) per optimizer step
  double max_grad_norm = 1.0;     // global-norm clipping
  double gamma = 7.0;             // loss decay over slots
  bool dpace = false;             // D-PACE's slot weights instead of the decay (dpace_weights)
  WarmupCosineSchedule schedule;  // peak lr 6e-4, warmup 4 %, cosine to 0 over total_steps
  AdamWOptions adamw;             // betas, eps, weight decay (its lr is unused: the schedule gives it)
  uint64_t seed = 0;              // data order and anchors
  bool shuffle = true;            // a fresh permutation of the examples every epoch
};

/// Position in the data: `index` into epoch `epoch`'s order of the examples.
struct DataPosition {
  int64_t epoch = 0, index = 0;
};

/// What one optimizer step did.
struct TrainStepStats {
  int64_t step = 0;                  // optimizer steps taken, this one included
  double loss = 0;                   // mean over the micro-batches that had loss weight
  double grad_norm = 0;              // global norm before clipping (NaN/Inf: step skipped)
  double lr = 0;                     // learning rate used
  int64_t micro_batches = 0, empty_micro_batches = 0;  // empty: no anchor / no loss weight
  int64_t tokens = 0;                // context tokens seen
  double target_ms = 0, drafter_ms = 0, optimizer_ms = 0;  // wall time per stage, summed over micro-batches
  double queue_ms = 0;               // drafter replicas waiting for taps, summed over micro-batches
  std::string nonfinite;             // a step skipped for NaN / Inf: which gradient, which example's taps
  std::vector<int64_t> slot_correct, slot_count;       // [B] top-1 hits per slot (as DrafterStepResult)
  bool skipped = false;              // non-finite gradient norm: weights and optimizer untouched
  /// (example index, its captured layers' numbers) for the micro-batches whose taps were checked.
  std::vector<std::pair<int64_t, std::vector<TapStats>>> tap_stats;
};

/// Trains a drafter, one sequence per micro-batch, on any DrafterBackend (CPU reference or GPU).
///
/// One step: for each of grad_accum micro-batches, take the next sample of the data order (a seeded
/// permutation per epoch, or 0..n-1 without shuffle), sample up to num_anchors anchors from its loss
/// mask with the trainer's RNG (sample_anchors), and let the backend run the target and the drafter's
/// forward + backward (gradients accumulated); average over the micro-batches that had loss weight (a
/// sample without any anchor candidate contributes nothing and is counted as empty); clip to
/// max_grad_norm; AdamW at schedule.lr(step). Deterministic on a deterministic backend: the same
/// options, data and seed give bitwise the same weights, on every run and across save / resume.
class DrafterTrainer {
 public:
  /// Throws std::invalid_argument for num_examples <= 0, grad_accum <= 0, num_anchors <= 0 or a
  /// null backend.
  DrafterTrainer(DrafterConfig cfg, std::unique_ptr<DrafterBackend> backend, int64_t num_examples, TrainerOptions opt);

  /// One optimizer step (see the class comment). Throws what the backend throws for a bad sample
  /// (the message names the sample index); the data position and RNG are then unchanged.
  TrainStepStats step(const SampleSource& source);

  /// Writes `dir` atomically: the servable DFlash checkpoint (config.json, bf16 model.safetensors)
  /// plus kTrainingStateFile: fp32 master weights ("master.<name>"), AdamW moments
  /// ("exp_avg.<name>", "exp_avg_sq.<name>"), and metadata (format "dflash-train-state-v1", step,
  /// data position, RNG state, seed, number of examples, options).
  void save(const std::string& dir) const;

  /// Restores the state saved by save(): weights from the fp32 masters (not the bf16 copy),
  /// optimizer moments and step, RNG, data position. Throws std::runtime_error naming the file when
  /// it is missing or malformed, when its config differs from this trainer's, or when the number of
  /// examples or the seed differ (the data order would not be the same).
  void resume(const std::string& dir);

  const DrafterConfig& config() const { return cfg_; }
  const DrafterBackend& backend() const { return *backend_; }
  DrafterBackend& backend() { return *backend_; }
  int64_t step_count() const { return step_; }
  DataPosition position() const { return pos_; }
  const TrainerOptions& options() const { return opt_; }

 private:
  int64_t next_example();
  void make_order();

  DrafterConfig cfg_;
  std::unique_ptr<DrafterBackend> backend_;
  int64_t num_examples_;
  TrainerOptions opt_;
  int64_t step_ = 0;            // optimizer steps taken
  std::mt19937_64 rng_;         // anchors
  DataPosition pos_;
  std::vector<int64_t> order_;  // permutation of epoch pos_.epoch
};

/// A fresh drafter as transformers' Qwen3 init does it (PreTrainedModel._init_weights with
/// initializer_range 0.02): every projection and fc ~ N(0, 0.02^2), every RMSNorm weight 1.
/// Normals from `seed` by Box-Muller over mt19937_64 (the same on every platform).
DrafterWeights<float> init_drafter_weights(const DrafterConfig& cfg, uint64_t seed, double std_dev = 0.02);

}  // namespace dflash
