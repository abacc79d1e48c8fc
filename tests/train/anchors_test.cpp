// Anchor sampling: candidates, sampling without replacement, sorting, seeding, uniformity.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "train/anchors.h"

using namespace dflash;

TEST(Anchors, CandidatesNeedTwoConsecutiveLossTokens) {
  const std::vector<uint8_t> m{0, 1, 1, 1, 0, 1, 0, 1, 1};
  EXPECT_EQ(anchor_candidates(m), (std::vector<int64_t>{1, 2, 7}));
  EXPECT_TRUE(anchor_candidates(std::vector<uint8_t>{1}).empty());
  EXPECT_TRUE(anchor_candidates(std::vector<uint8_t>{}).empty());
}

TEST(Anchors, SampleIsSortedDistinctSeededAndFresh) {
  std::vector<uint8_t> m(300, 1);
  for (int i = 0; i < 300; i += 7) m[size_t(i)] = 0;
  const auto cands = anchor_candidates(m);
  std::mt19937_64 a(42), b(42), c(43);
  const auto s1 = sample_anchors(m, 16, a);
  EXPECT_EQ(s1, sample_anchors(m, 16, b));   // same seed, same draw
  EXPECT_NE(s1, sample_anchors(m, 16, c));   // another seed, another draw
  EXPECT_NE(s1, sample_anchors(m, 16, a));   // the next step draws afresh
  ASSERT_EQ(s1.size(), 16u);
  EXPECT_TRUE(std::is_sorted(s1.begin(), s1.end()));
  EXPECT_EQ(std::set<int64_t>(s1.begin(), s1.end()).size(), 16u);
  for (int64_t p : s1) EXPECT_TRUE(std::binary_search(cands.begin(), cands.end(), p)) << p;
  EXPECT_EQ(sample_anchors(m, 100000, a), cands);  // fewer candidates than asked: all of them
  EXPECT_TRUE(sample_anchors(m, 0, a).empty());
  EXPECT_THROW(sample_anchors(m, -1, a), std::invalid_argument);
}

TEST(Anchors, EveryCandidateIsEquallyLikely) {
  const std::vector<uint8_t> m(21, 1);  // 20 candidates
  std::mt19937_64 rng(7);
  std::map<int64_t, int> hits;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i)
    for (int64_t p : sample_anchors(m, 5, rng)) ++hits[p];
  ASSERT_EQ(hits.size(), 20u);
  const double expected = draws * 5.0 / 20.0;  // 5000; sd about 61
  for (const auto& [p, n] : hits) EXPECT_NEAR(n, expected, 400) << "candidate " << p;
}
