// Wall-clock helpers for stage timings and progress reports.
#pragma once
#include <chrono>

namespace dflash {

/// Milliseconds of wall time (steady clock) since t0.
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dflash
