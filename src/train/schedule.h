// Learning-rate schedule of the drafter recipe (docs/dflash.md "Training", step 6:
// lr 6e-4, warmup 4% then cosine).
#pragma once
#include <cstdint>

namespace dflash {

/// Linear warmup then cosine decay to 0, exactly Hugging Face transformers'
/// get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, num_cycles=0.5)
/// with the warmup count of TrainingArguments.get_warmup_steps (ceil(total * warmup_ratio)):
///   W = warmup_steps(total, ratio) = ceil(total * ratio)
///   s < W:  lr(s) = peak * s / max(1, W)
///   s >= W: lr(s) = peak * max(0, 0.5 * (1 + cos(pi * (s - W) / max(1, total - W))))
/// `s` is the number of optimizer steps already taken (0 for the first step: as HF's LambdaLR, the
/// first update uses lr 0 when W > 0). For s >= total the factor is 0 (HF would rise again past
/// total; we clamp the progress to 1).
struct WarmupCosineSchedule {
  double peak_lr = 6e-4;
  int64_t total_steps = 0;
  double warmup_ratio = 0.04;

  /// ceil(total_steps * warmup_ratio), the double product as Python computes it (100 * 0.04 -> 4).
  int64_t warmup_steps() const;
  /// Multiplier in [0, 1] at step s (see above).
  double factor(int64_t s) const;
  /// peak_lr * factor(s).
  double lr(int64_t s) const { return peak_lr * factor(s); }
};

}  // namespace dflash
