// `dflash train` end to end on one device: target + data + drafter + the training loop with live
// telemetry, checkpoints, resume, signal handling and NaN guards.
#pragma once
#include <atomic>

#include "train/train_config.h"

namespace dflash {

/// Runs training as `c` says. Output directory layout:
///   OUT/train_config.json           the resolved configuration (drafter shape included)
///   OUT/metrics.jsonl               one line per logged step
///   OUT/tensorboard/                the same as TensorBoard event files (tensorboard --logdir OUT/tensorboard)
///   OUT/checkpoints/step-NNNNNNNN   every save_every steps, the last keep_last kept (atomic)
///   OUT/final                       the trained drafter (servable DFlash checkpoint + training state)
///   OUT/data                        raw chat files prepared for the run (when --data names files)
/// `stop` is polled after every step (set by SIGINT / SIGTERM): a checkpoint is written and the
/// function returns 128 + the signal number. Returns 0 when done. Throws std::runtime_error /
/// std::invalid_argument with a message naming the file, flag or sample at fault.
int run_training(const TrainConfig& c, const std::atomic<int>& stop);

}  // namespace dflash
