#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace dflash {

int64_t WarmupCosineSchedule::warmup_steps() const {
  // Python's math.ceil(num_training_steps * warmup_ratio), same double product.
  return int64_t(std::ceil(double(total_steps) * warmup_ratio));
}

double WarmupCosineSchedule::factor(int64_t s) const {
  const int64_t W = warmup_steps();
  if (s < 0) s = 0;
  if (s < W) return double(s) / double(std::max<int64_t>(1, W));
  const double progress = double(s - W) / double(std::max<int64_t>(1, total_steps - W));
  return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * std::min(1.0, progress))));
}

}  // namespace dflash
