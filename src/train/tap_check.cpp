#include "train/tap_check.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace dflash {

std::vector<TapStats> tap_stats(const float* taps, int64_t rows, const std::vector<int64_t>& layers, int64_t d) {
  if (rows < 0 || d <= 0 || layers.empty() || (rows > 0 && !taps))
    throw std::invalid_argument("tap_stats: bad sizes");
  const int64_t K = int64_t(layers.size());
  std::vector<TapStats> r(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) {
    TapStats& s = r[size_t(k)];
    s.layer = layers[size_t(k)], s.rows = rows;
    double sum = 0, sumsq = 0, first = NAN;
    int64_t n = 0, bad = 0, zero = 0;
    bool same = true;
    for (int64_t t = 0; t < rows; ++t) {
      const float* x = taps + t * K * d + k * d;
      bool row_bad = false, row_zero = true;
      for (int64_t j = 0; j < d; ++j) {
        if (!std::isfinite(x[j])) {
          row_bad = true;
          continue;
        }
        row_zero = row_zero && x[j] == 0.f;
        if (std::isnan(first)) first = x[j];
        same = same && x[j] == first;
        sum += x[j], sumsq += double(x[j]) * x[j], ++n;
      }
      bad += row_bad, zero += row_zero && !row_bad;
    }
    s.rms = n ? std::sqrt(sumsq / double(n)) : 0.0;
    s.nonfinite_rows = rows ? double(bad) / double(rows) : 0.0;
    s.zero_rows = rows ? double(zero) / double(rows) : 0.0;
    const double var = n ? sumsq / double(n) - (sum / double(n)) * (sum / double(n)) : 0.0;
    s.constant = n > 1 && (same || std::sqrt(std::max(var, 0.0)) <= 1e-6 * s.rms);
  }
  return r;
}

std::string tap_problem(const std::vector<TapStats>& v) {
  for (const TapStats& s : v) {
    const std::string at = fmt::format("target layer {}", s.layer);
    if (s.rows == 0) continue;
    if (s.nonfinite_rows > 0)
      return fmt::format("{}: {} of {} rows hold NaN / Inf", at, int64_t(std::lround(s.nonfinite_rows * double(s.rows))), s.rows);
    if (s.zero_rows >= 1.0) return at + ": every row is exactly zero";
    if (s.constant) return fmt::format("{}: constant (every element the same, RMS {:.4g})", at, s.rms);
  }
  return "";
}

std::string tap_summary(const std::vector<TapStats>& v) {
  std::string r;
  for (const TapStats& s : v)
    r += fmt::format("{}layer {} rms {:.4g} ({:.1f} % non-finite, {:.1f} % zero rows)", r.empty() ? "" : " | ", s.layer,
                     s.rms, 100.0 * s.nonfinite_rows, 100.0 * s.zero_rows);
  return r;
}

}  // namespace dflash
