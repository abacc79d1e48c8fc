// Decoding with a TargetCache against the full-sequence forward: logits of tokens fed piece by piece,
// packed batches of sequences of different lengths, and rollback (attention KV and the GatedDeltaNet
// conv window / recurrent state) against a recomputation from scratch.
#include <gtest/gtest.h>

#include <random>

#include "models/target.h"
#include "test_util.h"

using namespace dflash;

namespace {

std::vector<int32_t> random_ids(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> r(static_cast<size_t>(n));
  for (auto& t : r) t = int32_t(g() % uint32_t(V));
  return r;
}

ForwardOutput full(const TargetModel& m, const std::vector<int32_t>& ids) {
  ForwardOptions o;
  o.hidden_states = {1};
  return m.forward(ids, {0, int64_t(ids.size())}, o);
}

class CacheFixture : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(CacheFixture, PieceByPieceEqualsFullForward) {
  const auto m = TargetModel::load((test::fixtures_dir() / GetParam()).string());
  const auto ids = random_ids(23, m->spec().vocab_size, 1);
  const ForwardOutput want = full(*m, ids);
  TargetCache cache(m->spec(), 1);
  ForwardOptions o;
  o.hidden_states = {1};
  size_t at = 0;
  for (size_t piece : {5u, 1u, 1u, 7u, 2u, 7u}) {
    const std::vector<int32_t> part(ids.begin() + long(at), ids.begin() + long(at + piece));
    const ForwardOutput got = m->forward(part, {0, int64_t(piece)}, o, &cache);
    EXPECT_LE(test::rel_l2(got.logits.data, slice_rows(want.logits, int64_t(at), int64_t(at + piece)).data), 1e-5)
        << GetParam() << " tokens [" << at << ", " << at + piece << ")";
    EXPECT_LE(test::rel_l2(got.hidden_states.at(1).data,
                           slice_rows(want.hidden_states.at(1), int64_t(at), int64_t(at + piece)).data), 1e-5);
    at += piece;
  }
  EXPECT_EQ(cache.length(0), 23);
}

TEST_P(CacheFixture, PackedBatchContinuesEachSequence) {
  const auto m = TargetModel::load((test::fixtures_dir() / GetParam()).string());
  const int64_t V = m->spec().vocab_size;
  const std::vector<std::vector<int32_t>> seqs{random_ids(9, V, 2), random_ids(14, V, 3), random_ids(4, V, 4)};
  TargetCache cache(m->spec(), 3);
  ForwardOptions o;
  // Prefill different prefixes (one sequence gets nothing), then continue all of them at once.
  const std::vector<size_t> first{6, 0, 3};
  std::vector<int32_t> ids;
  std::vector<int64_t> cu{0};
  for (size_t s = 0; s < 3; ++s) {
    ids.insert(ids.end(), seqs[s].begin(), seqs[s].begin() + long(first[s]));
    cu.push_back(int64_t(ids.size()));
  }
  m->forward(ids, cu, o, &cache);
  ids.clear();
  cu = {0};
  for (size_t s = 0; s < 3; ++s) {
    ids.insert(ids.end(), seqs[s].begin() + long(first[s]), seqs[s].end());
    cu.push_back(int64_t(ids.size()));
  }
  const ForwardOutput got = m->forward(ids, cu, o, &cache);
  for (size_t s = 0; s < 3; ++s) {
    const ForwardOutput want = full(*m, seqs[s]);
    EXPECT_LE(test::rel_l2(slice_rows(got.logits, cu[s], cu[s + 1]).data,
                           slice_rows(want.logits, int64_t(first[s]), int64_t(seqs[s].size())).data), 1e-5)
        << GetParam() << " sequence " << s;
    EXPECT_EQ(cache.length(int(s)), int64_t(seqs[s].size()));
  }
}

TEST_P(CacheFixture, RollbackEqualsRecomputationFromScratch) {
  const auto m = TargetModel::load((test::fixtures_dir() / GetParam()).string());
  const int64_t V = m->spec().vocab_size;
  const auto prompt = random_ids(11, V, 5), block = random_ids(6, V, 6), next = random_ids(4, V, 7);
  for (int64_t keep : {0, 1, 3, 6}) {
    TargetCache cache(m->spec(), 1);
    ForwardOptions o;
    m->forward(prompt, {0, 11}, o, &cache);
    o.keep_rollback = true;
    m->forward(block, {0, 6}, o, &cache);  // a verify step
    cache.rollback(0, 11 + keep);
    // The state after the rollback equals a cache built from the committed tokens alone.
    std::vector<int32_t> committed = prompt;
    committed.insert(committed.end(), block.begin(), block.begin() + keep);
    TargetCache fresh(m->spec(), 1);
    m->forward(committed, {0, int64_t(committed.size())}, ForwardOptions{}, &fresh);
    ASSERT_EQ(cache.length(0), fresh.length(0));
    for (size_t l = 0; l < fresh.seqs[0].layers.size(); ++l) {
      const auto& a = cache.seqs[0].layers[l];
      const auto& b = fresh.seqs[0].layers[l];
      EXPECT_EQ(a.k.shape, b.k.shape) << "layer " << l;
      EXPECT_LE(test::rel_l2(a.k.data, b.k.data), test::kTolF32) << "layer " << l << " keys, keep " << keep;
      EXPECT_LE(test::rel_l2(a.v.data, b.v.data), test::kTolF32) << "layer " << l << " values, keep " << keep;
      EXPECT_LE(test::rel_l2(a.window.data, b.window.data), test::kTolF32) << "layer " << l << " conv window, keep " << keep;
      EXPECT_LE(test::rel_l2(a.state.data, b.state.data), test::kTolF32) << "layer " << l << " recurrent state, keep " << keep;
    }
    // And decoding continues as from scratch.
    const ForwardOutput got = m->forward(next, {0, 4}, ForwardOptions{}, &cache);
    committed.insert(committed.end(), next.begin(), next.end());
    const ForwardOutput want = full(*m, committed);
    EXPECT_LE(test::rel_l2(got.logits.data, slice_rows(want.logits, want.logits.dim(0) - 4, want.logits.dim(0)).data),
              1e-5)
        << GetParam() << " keep " << keep;
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, CacheFixture, ::testing::Values("llama", "qwen3", "qwen3_5_text"));

TEST(TargetCache, RollbackRefusesWhatWasNotKept) {
  const auto m = TargetModel::load((test::fixtures_dir() / "qwen3_5_text").string());
  TargetCache cache(m->spec(), 1);
  ForwardOptions o;
  m->forward(random_ids(8, m->spec().vocab_size, 8), {0, 8}, o, &cache);
  EXPECT_THROW(cache.rollback(0, 5), std::invalid_argument);   // GatedDeltaNet: no per-token states kept
  EXPECT_THROW(cache.rollback(0, 9), std::invalid_argument);   // past the end
  EXPECT_THROW(cache.rollback(1, 0), std::invalid_argument);   // no such sequence
  o.keep_rollback = true;
  m->forward(random_ids(4, m->spec().vocab_size, 9), {0, 4}, o, &cache);
  EXPECT_THROW(cache.rollback(0, 7), std::invalid_argument);   // before the kept forward
  EXPECT_NO_THROW(cache.rollback(0, 8));
  o.logits = false;
  EXPECT_THROW(m->forward({1}, {0, 1}, o, &cache), std::invalid_argument);  // a cache needs every layer run
  EXPECT_THROW(m->forward({1}, {0, 1, 1}, ForwardOptions{}, &cache), std::invalid_argument);  // 2 sequences, cache 1
}
