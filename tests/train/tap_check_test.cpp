// Tap integrity (src/train/tap_check.h): the numbers of a captured layer, and what stops a run.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "train/tap_check.h"

using namespace dflash;

TEST(TapCheck, NumbersOfEachLayer) {
  // 4 rows, two layers of d = 3: layer 5 normal but for one zero row, layer 9 with a NaN row.
  std::vector<float> t = {1, -1, 2, 0.5f, 0.5f, 0.5f,  //
                          0, 0, 0, 1, 2, 3,            //
                          3, 1, -2, NAN, 1, 1,         //
                          1, 1, 1, 2, 2, 2};
  const auto s = tap_stats(t.data(), 4, {5, 9}, 3);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].layer, 5);
  EXPECT_DOUBLE_EQ(s[0].zero_rows, 0.25);
  EXPECT_DOUBLE_EQ(s[0].nonfinite_rows, 0.0);
  EXPECT_NEAR(s[0].rms, std::sqrt((1 + 1 + 4 + 9 + 1 + 4 + 3.0) / 12), 1e-12);
  EXPECT_FALSE(s[0].constant);
  EXPECT_DOUBLE_EQ(s[1].nonfinite_rows, 0.25);
  EXPECT_EQ(tap_problem({s[0]}), "");
  EXPECT_EQ(tap_problem(s), "target layer 9: 1 of 4 rows hold NaN / Inf");
  EXPECT_NE(tap_summary(s).find("layer 5 rms"), std::string::npos);
}

TEST(TapCheck, ZeroAndConstantTapsAreRefusedByLayer) {
  std::vector<float> zero(12, 0.f), same(12, 0.37f), fine(12);
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  for (float& x : fine) x = nd(g);
  EXPECT_EQ(tap_problem(tap_stats(zero.data(), 4, {17}, 3)), "target layer 17: every row is exactly zero");
  EXPECT_NE(tap_problem(tap_stats(same.data(), 4, {2}, 3)).find("target layer 2: constant"), std::string::npos);
  EXPECT_EQ(tap_problem(tap_stats(fine.data(), 4, {2}, 3)), "");
  EXPECT_THROW(tap_stats(fine.data(), 4, {}, 3), std::invalid_argument);
}
