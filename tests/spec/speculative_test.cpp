// Speculative decoding on the CPU reference engine: lossless at temperature 0 (equal to plain greedy
// decoding, token for token) with drafters that are right, wrong, or right up to a varying slot; a
// drafter that copies the target's answers gives tau = block size; speculative sampling keeps the
// target's distribution; bad prompts give clear errors.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "spec/speculative.h"
#include "spec/oracle_drafter.h"
#include "test_util.h"
#include "train/trainer.h"

using namespace dflash;
using test::OracleDrafter;

namespace {

constexpr int64_t kB = 4;

DrafterConfig tiny_drafter(const ModelSpec& t) {
  DrafterOverrides ov;
  ov.num_hidden_layers = 1;
  ov.block_size = kB;
  ov.mask_token_id = t.vocab_size - 1;
  ov.target_layer_ids = std::vector<int64_t>{0, t.num_hidden_layers - 2};
  return derive_drafter_config(t, nullptr, ov);
}

std::vector<std::vector<int32_t>> prompts(int64_t V) {
  std::mt19937 g(11);
  std::vector<std::vector<int32_t>> r;
  for (int n : {7, 1, 12}) {
    r.emplace_back();
    for (int i = 0; i < n; ++i) r.back().push_back(int32_t(g() % uint32_t(V - 1)));
  }
  return r;
}

class SpecFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    model = TargetModel::load((test::fixtures_dir() / GetParam()).string());
    cfg = tiny_drafter(model->spec());
    decoder = make_cpu_decoder(*model, cfg.target_layer_ids);
    ps = prompts(model->spec().vocab_size);
  }
  /// prompt + plain greedy continuation of n tokens, per prompt.
  std::vector<std::vector<int32_t>> streams(int64_t n) {
    GenerateOptions o;
    o.max_new_tokens = n;
    const auto r = generate(*decoder, nullptr, ps, o);
    std::vector<std::vector<int32_t>> s = ps;
    for (size_t i = 0; i < s.size(); ++i) s[i].insert(s[i].end(), r.seqs[i].tokens.begin(), r.seqs[i].tokens.end());
    return s;
  }
  std::unique_ptr<TargetModel> model;
  DrafterConfig cfg;
  std::unique_ptr<TargetDecoder> decoder;
  std::vector<std::vector<int32_t>> ps;
};

}  // namespace

TEST_P(SpecFixture, GreedyIsLosslessWithARandomDrafter) {
  GenerateOptions o;
  o.max_new_tokens = 30;
  const auto plain = generate(*decoder, nullptr, ps, o);
  auto drafter = make_cpu_drafter(cfg, init_drafter_weights(cfg, 3), model->embed_tokens(), model->lm_head());
  const auto spec = generate(*decoder, drafter.get(), ps, o);
  for (size_t s = 0; s < ps.size(); ++s) {
    EXPECT_EQ(spec.seqs[s].tokens, plain.seqs[s].tokens) << GetParam() << " prompt " << s;
    EXPECT_EQ(int64_t(plain.seqs[s].tokens.size()), 30);
    EXPECT_FALSE(spec.seqs[s].accepted.empty());
  }
  const AcceptanceStats a = acceptance_stats(spec.seqs, kB);
  EXPECT_GE(a.tau, 1.0);
  EXPECT_LE(a.tau, double(kB));
}

// A DSpark drafter drafts every slot (B tokens, B + 1 verified) along its Markov walk: still
// lossless, and a verify step can commit up to B + 1 tokens.
TEST_P(SpecFixture, GreedyIsLosslessWithADsparkDrafter) {
  GenerateOptions o;
  o.max_new_tokens = 30;
  const auto plain = generate(*decoder, nullptr, ps, o);
  DrafterConfig dc = cfg;
  dc.markov_rank = 4;
  DrafterWeights<float> w = init_drafter_weights(dc, 3);
  for (float& x : w.markov_w2.data) x = 0.5f;  // (init leaves the Markov bias at 0)
  auto drafter = make_cpu_drafter(dc, std::move(w), model->embed_tokens(), model->lm_head());
  drafter->reset(1);
  Tensor taps({1, int64_t(dc.target_layer_ids.size()) * dc.hidden_size});
  drafter->append_context(0, taps);
  EXPECT_EQ(drafter->draft({3}).at(0).size(), size_t(kB));
  const auto spec = generate(*decoder, drafter.get(), ps, o);
  for (size_t s = 0; s < ps.size(); ++s) EXPECT_EQ(spec.seqs[s].tokens, plain.seqs[s].tokens) << GetParam() << " prompt " << s;
  // An oracle drafting B tokens (DSpark's count), right or wrong at a moving slot: still lossless,
  // and steps commit every count up to B + 1.
  const auto st = streams(30 + kB + 2);
  OracleDrafter oracle(dc, st, true);
  const auto os = generate(*decoder, &oracle, ps, o);
  for (size_t s = 0; s < ps.size(); ++s) EXPECT_EQ(os.seqs[s].tokens, plain.seqs[s].tokens) << GetParam() << " prompt " << s;
  const AcceptanceStats a = acceptance_stats(os.seqs, dc.drafts_per_block() + 1);
  ASSERT_EQ(a.histogram.size(), size_t(kB + 2));
  EXPECT_GT(a.histogram[size_t(kB + 1)], 0) << "no step committed all B drafts + 1";
  EXPECT_GT(a.histogram[1], 0);
}

// Continuous batching: with fewer slots than prompts, finished slots take the next prompt (its
// prefill joins the others' decode step); the outputs do not change.
TEST_P(SpecFixture, ContinuousBatchingChangesNothing) {
  GenerateOptions o;
  o.max_new_tokens = 25;
  const auto all = generate(*decoder, nullptr, ps, o);
  auto drafter = make_cpu_drafter(cfg, init_drafter_weights(cfg, 3), model->embed_tokens(), model->lm_head());
  int64_t finished = 0;
  o.on_finished = [&](int64_t k) { finished = k; };
  for (int slots : {1, 2}) {
    o.max_batch = slots;
    const auto plain = generate(*decoder, nullptr, ps, o);
    const auto spec = generate(*decoder, drafter.get(), ps, o);
    for (size_t s = 0; s < ps.size(); ++s) {
      EXPECT_EQ(plain.seqs[s].tokens, all.seqs[s].tokens) << slots << " slots, prompt " << s;
      EXPECT_EQ(spec.seqs[s].tokens, all.seqs[s].tokens) << slots << " slots, prompt " << s << " (drafter)";
      EXPECT_GT(spec.seqs[s].ttft_ms, 0.0);
    }
    EXPECT_EQ(finished, int64_t(ps.size()));
  }
  // Prompt 0 stops early, so prompt 2's prefill runs in the same step as prompt 1's verification:
  // between that verification and its rollback (which GatedDeltaNet states must survive).
  o.max_batch = 2;
  o.stop_token_ids = {all.seqs[0].tokens[4]};
  const auto plain = generate(*decoder, nullptr, ps, o);
  const auto spec = generate(*decoder, drafter.get(), ps, o);
  EXPECT_TRUE(plain.seqs[0].stopped);
  for (size_t s = 0; s < ps.size(); ++s) EXPECT_EQ(spec.seqs[s].tokens, plain.seqs[s].tokens) << "prompt " << s;
}

TEST_P(SpecFixture, GreedyIsLosslessForEveryAcceptanceLength) {
  GenerateOptions o;
  o.max_new_tokens = 40;
  const auto plain = generate(*decoder, nullptr, ps, o);
  OracleDrafter drafter(cfg, streams(40 + kB + 1), /*corrupt=*/true);
  const auto spec = generate(*decoder, &drafter, ps, o);
  for (size_t s = 0; s < ps.size(); ++s) EXPECT_EQ(spec.seqs[s].tokens, plain.seqs[s].tokens) << "prompt " << s;
  const AcceptanceStats a = acceptance_stats(spec.seqs, kB);
  for (int64_t j = 1; j <= kB; ++j) EXPECT_GT(a.histogram[size_t(j)], 0) << "no step committed " << j << " tokens";
}

TEST_P(SpecFixture, CopyingDrafterGivesTauEqualToBlockSize) {
  GenerateOptions o;
  o.max_new_tokens = 21;
  OracleDrafter drafter(cfg, streams(21 + kB + 1), /*corrupt=*/false);
  const auto spec = generate(*decoder, &drafter, ps, o);
  const AcceptanceStats a = acceptance_stats(spec.seqs, kB);
  EXPECT_DOUBLE_EQ(a.tau, double(kB));
  EXPECT_EQ(a.histogram[size_t(kB)], a.steps);
  for (int64_t k = 0; k < kB; ++k) EXPECT_DOUBLE_EQ(a.slot_accept[size_t(k)], 1.0);
  for (const auto& q : spec.seqs) {
    EXPECT_EQ(q.tokens.size(), 21u);
    EXPECT_EQ(q.accepted.size(), 5u);  // 1 token from the prefill, then 5 steps of 4
  }
}

TEST_P(SpecFixture, StopTokenEndsTheSequenceAsPlainDecodingDoes) {
  GenerateOptions o;
  o.max_new_tokens = 30;
  const auto s0 = streams(30)[0];
  o.stop_token_ids = {s0[ps[0].size() + 9]};  // the 10th generated token of prompt 0
  const auto plain = generate(*decoder, nullptr, ps, o);
  OracleDrafter drafter(cfg, streams(30 + kB + 1), /*corrupt=*/true);
  const auto spec = generate(*decoder, &drafter, ps, o);
  EXPECT_TRUE(plain.seqs[0].stopped);
  EXPECT_LE(plain.seqs[0].tokens.size(), 10u);
  for (size_t s = 0; s < ps.size(); ++s) {
    EXPECT_EQ(spec.seqs[s].tokens, plain.seqs[s].tokens) << "prompt " << s;
    EXPECT_EQ(spec.seqs[s].stopped, plain.seqs[s].stopped);
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, SpecFixture, ::testing::Values("llama", "qwen3", "qwen3_5_text"));

// With sampling, the second generated token (the first one that goes through verification) must
// follow the target's distribution whatever the drafter proposes. Its exact distribution is
// sum_t1 p(t1) p(t2 | t1), computed with the model; a drafter proposes the most likely second
// token at every slot, and 4000 speculative draws must give that token's probability within 4
// standard errors (accepting the proposal too often or too rarely moves it far more).
TEST(SpeculativeSampling, KeepsTheTargetDistribution) {
  const auto model = TargetModel::load((test::fixtures_dir() / "llama").string());
  const DrafterConfig cfg = tiny_drafter(model->spec());
  auto decoder = make_cpu_decoder(*model, cfg.target_layer_ids);
  const int64_t V = model->spec().vocab_size;
  const double T = 0.25;
  const std::vector<int32_t> prompt{5, 17, 42};
  auto softmax = [&](const float* row) {
    std::vector<double> p(static_cast<size_t>(V));
    const double mx = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += (p[size_t(i)] = std::exp((row[i] - mx) / T));
    for (double& x : p) x /= sum;
    return p;
  };
  // Exact: one forward over all V continuations prompt + [t1].
  std::vector<std::vector<int32_t>> all;
  for (int32_t t = 0; t < V; ++t) {
    all.push_back(prompt);
    all.back().push_back(t);
  }
  decoder->reset(int(all.size()));
  const auto out = decoder->feed(all, false, true);
  std::vector<double> exact(static_cast<size_t>(V), 0.0);
  const std::vector<double> p1 = softmax(out[0].logits.row(2));
  for (int64_t t = 0; t < V; ++t) {
    const std::vector<double> p2 = softmax(out[size_t(t)].logits.row(3));
    for (int64_t u = 0; u < V; ++u) exact[size_t(u)] += p1[size_t(t)] * p2[size_t(u)];
  }
  const auto d = int32_t(std::max_element(exact.begin(), exact.end()) - exact.begin());
  class Fixed final : public BlockDrafter {
   public:
    Fixed(DrafterConfig c, int32_t t) : c_(std::move(c)), t_(t) {}
    const DrafterConfig& config() const override { return c_; }
    void reset(int) override {}
    void clear(int) override {}
    void append_context(int, const Tensor&) override {}
    std::vector<std::vector<int32_t>> draft(const std::vector<int32_t>& last) override {
      std::vector<std::vector<int32_t>> r(last.size());
      for (size_t s = 0; s < last.size(); ++s)
        if (last[s] >= 0) r[s].assign(size_t(c_.block_size - 1), t_);
      return r;
    }
    std::string describe() const override { return "fixed"; }

   private:
    DrafterConfig c_;
    int32_t t_;
  } fixed(cfg, d);
  const int N = 4000;
  double hits = 0, plain_hits = 0;
  for (uint64_t rep = 0; rep < 10; ++rep) {
    GenerateOptions o;
    o.max_new_tokens = 2;
    o.temperature = T;
    o.seed = 100 + rep;
    const std::vector<std::vector<int32_t>> batch(size_t(N / 10), prompt);
    for (const auto& q : generate(*decoder, &fixed, batch, o).seqs) hits += q.tokens.at(1) == d;
    for (const auto& q : generate(*decoder, nullptr, batch, o).seqs) plain_hits += q.tokens.at(1) == d;
  }
  const double P = exact[size_t(d)], se = std::sqrt(P * (1 - P) / N);
  EXPECT_GT(P, 0.1) << "the proposal should be likely enough for the test to mean something";
  EXPECT_NEAR(hits / N, P, 4 * se) << "speculative sampling";
  EXPECT_NEAR(plain_hits / N, P, 4 * se) << "plain sampling";
}

TEST(Speculative, BadPromptsAndDraftersGiveClearErrors) {
  const auto model = TargetModel::load((test::fixtures_dir() / "llama").string());
  const DrafterConfig cfg = tiny_drafter(model->spec());
  auto decoder = make_cpu_decoder(*model, cfg.target_layer_ids);
  GenerateOptions o;
  auto msg = [&](const std::vector<std::vector<int32_t>>& p) {
    try {
      generate(*decoder, nullptr, p, o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg({{1, 2}, {}}).find("prompt 1 is empty"), std::string::npos);
  EXPECT_NE(msg({{1, 301}}).find("outside the target's vocabulary of 301"), std::string::npos);
  EXPECT_NE(msg({std::vector<int32_t>(256, 1)}).find("max_position_embeddings 256"), std::string::npos);
  // Near the limit, generation stops there instead of failing.
  o.max_new_tokens = 50;
  const auto r = generate(*decoder, nullptr, {std::vector<int32_t>(250, 1)}, o);
  EXPECT_TRUE(r.seqs[0].hit_context_limit);
  EXPECT_EQ(r.seqs[0].tokens.size(), 7u);  // the last one at position 256 is never fed
  // With a drafter, the last blocks that would not fit become one-token steps: the same output.
  auto drafter = make_cpu_drafter(cfg, init_drafter_weights(cfg, 3), model->embed_tokens(), model->lm_head());
  const auto rs = generate(*decoder, drafter.get(), {std::vector<int32_t>(250, 1)}, o);
  EXPECT_EQ(rs.seqs[0].tokens, r.seqs[0].tokens);
  EXPECT_TRUE(rs.seqs[0].hit_context_limit);
  DrafterConfig wide = cfg;
  wide.hidden_size += 1;
  EXPECT_THROW(check_drafter_fits(wide, model->spec(), "d"), std::invalid_argument);
  DrafterConfig deep = cfg;
  deep.target_layer_ids = {0, 3};
  EXPECT_THROW(check_drafter_fits(deep, model->spec(), "d"), std::invalid_argument);
  EXPECT_THROW(make_cpu_decoder(*model, {3}), std::invalid_argument);
}
