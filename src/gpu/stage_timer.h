// CUDA events around named stages of a GPU computation (where the time goes): the drafter step's and
// the target forward's stage breakdowns. CUDA builds only.
#pragma once
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// Records an event pair per begin / end on `stream` while on; totals per name (ms) once the stream
/// is synchronized. Stages of one name may repeat (they add up); begin / end pairs may nest (a
/// stage inside another counts in both). next / stop chain stages one after the other. Not
/// thread-safe: one timer per stream. Throws std::runtime_error on CUDA errors.
class StageTimer {
 public:
  StageTimer(cudaStream_t s, bool on) : s_(s), on_(on) {}
  ~StageTimer() { clear(); }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;
  bool on() const { return on_; }
  void begin(const std::string& name) {
    if (!on_) return;
    Mark m{name, nullptr, nullptr, false};
    DFLASH_CUDA_CHECK(cudaEventCreate(&m.e0));
    DFLASH_CUDA_CHECK(cudaEventCreate(&m.e1));
    DFLASH_CUDA_CHECK(cudaEventRecord(m.e0, s_));
    marks_.push_back(m);
  }
  void end(const std::string& name) {
    if (!on_) return;
    for (auto it = marks_.rbegin(); it != marks_.rend(); ++it)
      if (it->name == name && !it->ended) {
        DFLASH_CUDA_CHECK(cudaEventRecord(it->e1, s_));
        it->ended = true;
        return;
      }
  }
  /// Ends the stage the last next() began (if still open) and begins `name`: consecutive stages.
  void next(const std::string& name) {
    if (!on_) return;
    stop();
    begin(name);
    chained_ = int(marks_.size()) - 1;
  }
  /// Ends the stage the last next() began (if still open).
  void stop() {
    if (!on_ || chained_ < 0) return;
    DFLASH_CUDA_CHECK(cudaEventRecord(marks_[size_t(chained_)].e1, s_));
    marks_[size_t(chained_)].ended = true;
    chained_ = -1;
  }
  /// Totals per name in first-seen order (the stream must be synchronized); stages never ended (an
  /// exception left them open) are left out.
  std::vector<std::pair<std::string, double>> totals() const {
    std::vector<std::pair<std::string, double>> r;
    for (const auto& m : marks_) {
      if (!m.ended) continue;
      float ms = 0;
      DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, m.e0, m.e1));
      auto it = std::find_if(r.begin(), r.end(), [&](const auto& p) { return p.first == m.name; });
      if (it == r.end()) r.emplace_back(m.name, ms);
      else it->second += ms;
    }
    return r;
  }
  /// Drops every mark (and its events).
  void clear() {
    for (auto& m : marks_) cudaEventDestroy(m.e0), cudaEventDestroy(m.e1);
    marks_.clear();
    chained_ = -1;
  }

 private:
  struct Mark {
    std::string name;
    cudaEvent_t e0, e1;
    bool ended;
  };
  cudaStream_t s_;
  bool on_;
  std::vector<Mark> marks_;
  int chained_ = -1;  // the mark next() began, while open
};

}  // namespace dflash::cuda
