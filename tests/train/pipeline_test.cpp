// The scheduling of the multi-replica pipeline (src/train/pipeline.h), on threads without GPUs:
// packing runs, balancing by tokens, and the target -> drafter queues: every drafter gets exactly its
// micro-batches in increasing order, whatever the timing, with no deadlock; cancel() frees everyone.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <stdexcept>
#include <thread>

#include "train/pipeline.h"

using namespace dflash;

namespace {

struct Batch {
  std::vector<TrainSample> samples;
  std::vector<MicroBatch> mbs;
  explicit Batch(const std::vector<int>& lengths) {
    samples.resize(lengths.size());
    for (size_t j = 0; j < lengths.size(); ++j) {
      samples[j].index = int64_t(j);
      samples[j].ids.assign(size_t(lengths[j]), 1);
      samples[j].loss_mask.assign(size_t(lengths[j]), 1);
    }
    for (auto& s : samples) mbs.push_back({&s, {}});
  }
};

}  // namespace

TEST(Pipeline, PackRunsKeepsOrderAndBudget) {
  const Batch b({300, 500, 200, 9000, 100, 100});
  const auto runs = pack_runs({0, 1, 2, 3, 4, 5}, b.mbs, 1000);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0], (std::vector<size_t>{0, 1, 2}));  // 1000 tokens: fits exactly
  EXPECT_EQ(runs[1], (std::vector<size_t>{3}));        // longer than the budget: alone
  EXPECT_EQ(runs[2], (std::vector<size_t>{4, 5}));
  EXPECT_EQ(pack_runs({1, 4}, b.mbs, 1).size(), 2u);  // budget 1: one sample per forward
  EXPECT_TRUE(pack_runs({}, b.mbs, 1000).empty());
}

TEST(Pipeline, BalanceIsLongestFirstToTheLeastLoaded) {
  const Batch b({100, 400, 300, 200});
  // 400 -> r0, 300 -> r1, 200 -> r1 (300 < 400), 100 -> r0 (400 < 500)
  EXPECT_EQ(balance(b.mbs, 2), (std::vector<size_t>{0, 0, 1, 1}));
  EXPECT_EQ(balance(b.mbs, 1), (std::vector<size_t>{0, 0, 0, 0}));
  const Batch ties({50, 50, 50});  // equal lengths: in order, to the lower replica first
  EXPECT_EQ(balance(ties.mbs, 2), (std::vector<size_t>{0, 1, 0}));
}

TEST(Pipeline, OnThreadsRethrowsTheLowestFailure) {
  std::atomic<int> ran{0};
  try {
    on_threads(4, [&](size_t i) {
      ++ran;
      if (i == 1 || i == 3) throw std::runtime_error("worker " + std::to_string(i));
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "worker 1");
  }
  EXPECT_EQ(ran.load(), 4);
}

// Targets push their micro-batches (increasing index) to the drafter each is balanced to; drafters
// pop theirs in increasing index order. Random delays on both sides, many shapes.
TEST(Pipeline, HandoffDeliversInOrderWithoutDeadlock) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 60; ++trial) {
    const size_t nt = 1 + rng() % 3, nd = 1 + rng() % 3, n = 1 + rng() % 12, cap = 1 + rng() % 2;
    std::vector<int> lengths;
    for (size_t j = 0; j < n; ++j) lengths.push_back(1 + int(rng() % 50));
    const Batch b(lengths);
    const auto tj = balance(b.mbs, nt), dj = balance(b.mbs, nd);
    Handoff<size_t> hand(nt, nd, cap);
    std::vector<std::vector<size_t>> got(nd);
    const uint64_t seed = rng();
    const auto t0 = std::chrono::steady_clock::now();
    on_threads(nt + nd, [&](size_t w) {
      std::mt19937_64 r(seed + w);
      auto nap = [&] { std::this_thread::sleep_for(std::chrono::microseconds(r() % 300)); };
      if (w < nt) {
        for (size_t j = 0; j < n; ++j)
          if (tj[j] == w) nap(), hand.push(w, dj[j], j);
      } else {
        for (size_t j = 0; j < n; ++j)
          if (dj[j] == w - nt) {
            nap();
            got[w - nt].push_back(hand.pop(tj[j], w - nt));
          }
      }
    });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
    for (size_t d = 0; d < nd; ++d) {
      std::vector<size_t> want;
      for (size_t j = 0; j < n; ++j)
        if (dj[j] == d) want.push_back(j);
      EXPECT_EQ(got[d], want) << "trial " << trial << " drafter " << d;
    }
  }
}

TEST(Pipeline, CancelReleasesBlockedWorkers) {
  Handoff<int> hand(1, 1, 1);
  hand.push(0, 0, 1);  // the queue is full now
  std::atomic<int> cancelled{0};
  std::thread producer([&] {
    try {
      hand.push(0, 0, 2);  // blocks: full
    } catch (const Cancelled&) {
      ++cancelled;
    }
  });
  Handoff<int> empty(1, 1, 1);
  std::thread consumer([&] {
    try {
      (void)empty.pop(0, 0);  // blocks: empty
    } catch (const Cancelled&) {
      ++cancelled;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  hand.cancel();
  empty.cancel();
  producer.join();
  consumer.join();
  EXPECT_EQ(cancelled.load(), 2);
}
