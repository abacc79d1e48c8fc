// Tap integrity: the numbers of a sample's captured target layers (RMS, rows that are non-finite or
// exactly zero, a constant tap), checked on the first micro-batches of every run. The most common
// silent failure of a drafter is trained-on garbage taps (wrong layer ids, a target backend that hands
// back zeros): a tap that is all zero, constant or non-finite stops the run, naming the layer.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dflash {

/// One captured layer over the rows of one sample.
struct TapStats {
  int64_t layer = 0;            // target layer id (its output, hidden_states[layer + 1])
  int64_t rows = 0;
  double rms = 0;               // over the finite elements
  double nonfinite_rows = 0;    // fraction of rows holding NaN / Inf
  double zero_rows = 0;         // fraction of rows that are exactly zero
  bool constant = false;        // every finite element equal (standard deviation 0 relative to the RMS)
};

/// Stats of taps [rows, layers.size() * d] (float32, layer k in columns [k d, (k + 1) d)). Throws
/// std::invalid_argument when the sizes disagree.
std::vector<TapStats> tap_stats(const float* taps, int64_t rows, const std::vector<int64_t>& layers, int64_t d);

/// "" when every layer is usable; else what is wrong with the first bad one: "target layer L: all
/// rows zero" / "...: N of M rows non-finite" / "...: constant (every element X)".
std::string tap_problem(const std::vector<TapStats>& s);

/// One line of the numbers, "layer 3 rms 0.812 (0.0 % non-finite, 0.0 % zero rows) | ...".
std::string tap_summary(const std::vector<TapStats>& s);

}  // namespace dflash
