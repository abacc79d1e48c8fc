// A test drafter that knows the target's greedy continuation in advance (see OracleDrafter).
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "spec/decoder.h"

namespace dflash::test {

/// Drafts the target's own greedy continuation (known in advance), optionally wrong at one slot
/// that moves every step, so that every acceptance length occurs.
class OracleDrafter final : public BlockDrafter {
 public:
  OracleDrafter(DrafterConfig c, std::vector<std::vector<int32_t>> streams, bool corrupt)
      : c_(std::move(c)), streams_(std::move(streams)), corrupt_(corrupt) {}
  const DrafterConfig& config() const override { return c_; }
  void reset(int n) override { len_.assign(size_t(n), 0); }
  void clear(int s) override { len_.at(size_t(s)) = 0; }
  void append_context(int s, const Tensor& taps) override { len_[size_t(s)] += taps.dim(0); }
  std::vector<std::vector<int32_t>> draft(const std::vector<int32_t>& last) override {
    std::vector<std::vector<int32_t>> r(last.size());
    for (size_t s = 0; s < last.size(); ++s) {
      if (last[s] < 0) continue;
      const auto& st = streams_[s];
      const int64_t p = len_[s];
      EXPECT_EQ(st.at(size_t(p)), last[s]) << "the decoding loop fed a token the target did not choose";
      // (DFlash: B - 1 drafts; DSpark: B)
      for (int64_t k = 1; k <= c_.drafts_per_block(); ++k) r[s].push_back(st.at(size_t(p + k)));
      if (corrupt_) {
        const size_t slot = size_t(step_++ % (c_.drafts_per_block() + 1));  // the last value means: none wrong
        if (slot < r[s].size()) r[s][slot] = (r[s][slot] + 1) % int32_t(c_.vocab_size);
      }
    }
    return r;
  }
  std::string describe() const override { return "oracle"; }

 private:
  DrafterConfig c_;
  std::vector<std::vector<int32_t>> streams_;
  bool corrupt_;
  std::vector<int64_t> len_;
  int64_t step_ = 0;
};

}  // namespace dflash::test
