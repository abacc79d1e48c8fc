// DSpark on the CPU (src/models/dspark.h): its rows, its loss against a case worked by hand, the loss's
// and the whole step's gradients against finite differences (float64, the detached confidence target
// held fixed as autograd holds it), greedy drafting against the training forward, and the config.json
// and checkpoint as SGLang and vLLM read them.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>

#include "models/drafter_checkpoint.h"
#include "models/dspark.h"
#include "tensor/dtype.h"
#include "test_util.h"

using namespace dflash;

namespace {

/// A small DSpark drafter: 2 layers (one sliding), 2 query / 1 key-value heads of 8, block 4.
DrafterConfig tiny_dspark() {
  DrafterConfig c;
  c.hidden_size = 16, c.intermediate_size = 24, c.num_hidden_layers = 2;
  c.num_attention_heads = 2, c.num_key_value_heads = 1, c.head_dim = 8;
  c.vocab_size = 37, c.block_size = 4, c.num_target_layers = 4, c.target_layer_ids = {0, 2};
  c.mask_token_id = 36, c.layer_types = {"sliding_attention", "full_attention"}, c.sliding_window = 5;
  c.markov_rank = 3;
  c.validate("tiny dspark");
  return c;
}

template <typename T>
void fill(BasicTensor<T>& t, std::mt19937_64& rng, double sd, double mean = 0) {
  std::normal_distribution<double> nd(mean, sd);
  for (T& x : t.data) x = T(nd(rng));
}

/// A DSpark step's inputs: random weights (heads included), taps, target hidden states and ids.
template <typename T>
struct Problem {
  DrafterConfig cfg = tiny_dspark();
  DrafterWeights<T> w = drafter_zeros<T>(cfg);
  BasicTensor<T> taps, embed, lm_head, g;
  DrafterSequence<T> seq;
  explicit Problem(uint64_t seed = 5) {
    std::mt19937_64 rng(seed);
    for (auto& [name, t] : w.named()) fill(*t, rng, t->ndim() == 1 ? 0.1 : 0.3, t->ndim() == 1 && name != "confidence_head.proj.bias" ? 1.0 : 0.0);
    const int64_t S = 13, d = cfg.hidden_size, V = cfg.vocab_size;
    taps = BasicTensor<T>({S, 2 * d}), embed = BasicTensor<T>({V, d}), lm_head = BasicTensor<T>({V, d});
    g = BasicTensor<T>({S, d});
    for (auto* t : {&taps, &embed, &lm_head, &g}) fill(*t, rng, 1.0);
    for (int64_t i = 0; i < S; ++i) seq.ids.push_back(int64_t(rng() % uint64_t(V - 1)));
    seq.loss_mask = {0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1};
    seq.anchors = {1, 2, 6, 10};
    seq.num_blocks = 5;  // one padding block
    seq.taps = &taps, seq.embed = &embed, seq.lm_head = &lm_head, seq.target_hidden = &g;
    seq.gamma = 4.0;
  }
};

}  // namespace

TEST(DSpark, RowsFollowDeepSpecsConvention) {
  // Slot k predicts ids[a + k + 1] from prev ids[a + k]; the weights stop at the first slot without
  // a label (past the end or outside the loss mask) and stay 0 after it.
  const std::vector<int64_t> ids = {10, 11, 12, 13, 14, 15, 16, 17}, mask = {0, 1, 1, 0, 1, 1, 1, 1};
  const DSparkRows r = dspark_rows(ids, mask, {0, 3, 6}, 4, 3, 2.0);
  const std::vector<double> w = {1, std::exp(-0.5), 0, 1, std::exp(-0.5), std::exp(-1.0), 1, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < w.size(); ++i) EXPECT_DOUBLE_EQ(r.weights[i], w[i]) << "row " << i;
  EXPECT_EQ(r.labels[0], 11);
  EXPECT_EQ(r.prev[0], 10);
  EXPECT_EQ(r.labels[4], 15);
  EXPECT_EQ(r.prev[4], 14);
  EXPECT_EQ(r.target_row[5], 5);
  EXPECT_EQ(r.labels[6], 17);
  EXPECT_NEAR(r.weight_sum, 3 + 2 * std::exp(-0.5) + std::exp(-1.0), 1e-15);
  EXPECT_THROW(dspark_rows(ids, mask, {8}, 1, 3, 2.0), std::invalid_argument);
  EXPECT_THROW(dspark_rows(ids, mask, {0}, 1, 3, 0.0), std::invalid_argument);
}

TEST(DSpark, LossOfOneRowByHand) {
  // V = 2, d = 1, r = 1, one row: h = 1, lm_head = [1, -1], W1[prev = 0] = 2, W2 = [0.5, 0],
  // target hidden 0 (its distribution is uniform), w_c = [1, 0.25], b_c = -1, label 1.
  DrafterWeights<double> w;
  w.markov_w1 = BasicTensor<double>({2, 1}), w.markov_w2 = BasicTensor<double>({2, 1});
  w.confidence_w = BasicTensor<double>({1, 2}), w.confidence_b = BasicTensor<double>({1});
  w.markov_w1.data = {2, 7}, w.markov_w2.data = {0.5, 0}, w.confidence_w.data = {1, 0.25}, w.confidence_b.data = {-1};
  BasicTensor<double> h({1, 1}), g({1, 1}), lm({2, 1});
  h.data = {1}, g.data = {0}, lm.data = {1, -1};
  DSparkRows rows;
  rows.labels = {1}, rows.prev = {0}, rows.target_row = {0}, rows.weights = {1}, rows.weight_sum = 1;
  DrafterGrads<double> gr = w;
  for (auto* t : {&gr.markov_w1, &gr.markov_w2, &gr.confidence_w, &gr.confidence_b}) std::fill(t->data.begin(), t->data.end(), 0.0);
  const DSparkLossResult<double> r = dspark_loss(w, h, g, lm, rows, 1, &gr);
  // z = [1 + 0.5 * 2, -1] = [2, -1]; p = softmax(z); q = [0.5, 0.5]
  const double p0 = 1 / (1 + std::exp(-3.0)), p1 = 1 - p0;
  const double ce = std::log(std::exp(2.0) + std::exp(-1.0)) + 1;
  const double l1 = std::abs(p0 - 0.5) + std::abs(p1 - 0.5), y = 1 - l1 / 2;
  const double c = 1 * 1 + 0.25 * 2 - 1;  // w_c . [h ; e] + b_c = 0.5
  const double bce = std::log(1 + std::exp(-c)) + (1 - y) * c;
  EXPECT_NEAR(r.ce, ce, 1e-14);
  EXPECT_NEAR(r.l1, l1, 1e-14);
  EXPECT_NEAR(r.bce, bce, 1e-14);
  EXPECT_NEAR(r.loss, 0.1 * ce + 0.9 * l1 + bce, 1e-14);
  EXPECT_NEAR(r.confidence_targets[0], y, 1e-15);
  // d/dz: 0.1 (p - onehot(1)) + 0.9 p (s - s.p), s = [+1, -1]
  const double sp = p0 - p1;
  const double dz0 = 0.1 * p0 + 0.9 * p0 * (1 - sp), dz1 = 0.1 * (p1 - 1) + 0.9 * p1 * (-1 - sp);
  const double dc = 1 / (1 + std::exp(-c)) - y;
  EXPECT_NEAR(r.dh.data[0], dz0 * 1 + dz1 * -1 + dc * 1, 1e-14);        // lm_head^T dz + dc w_c[h]
  EXPECT_NEAR(gr.markov_w2.data[0], dz0 * 2, 1e-14);                      // dW2[v] = dz_v e
  EXPECT_NEAR(gr.markov_w2.data[1], dz1 * 2, 1e-14);
  EXPECT_NEAR(gr.markov_w1.data[0], dz0 * 0.5 + dz1 * 0 + dc * 0.25, 1e-14);  // W2^T dz + dc w_c[e]
  EXPECT_EQ(gr.markov_w1.data[1], 0.0);                                   // an unused row
  EXPECT_NEAR(gr.confidence_w.data[0], dc * 1, 1e-14);
  EXPECT_NEAR(gr.confidence_w.data[1], dc * 2, 1e-14);
  EXPECT_NEAR(gr.confidence_b.data[0], dc, 1e-14);
  EXPECT_EQ(r.slot_correct[0], 0);  // argmax z = 0, label 1
  EXPECT_EQ(r.slot_count[0], 1);
}

TEST(DSpark, StepGradientsMatchFiniteDifferencesFloat64) {
  Problem<double> p;
  const DrafterStepResult<double> r = drafter_step(p.cfg, p.w, p.seq);
  ASSERT_GT(r.weight_sum, 0);
  // The confidence target is detached: hold it fixed while perturbing, as autograd does.
  p.seq.confidence_targets = &r.confidence_targets;
  DrafterStepOptions fwd;
  fwd.backward = false;
  std::mt19937_64 rng(9);
  std::normal_distribution<double> nd;
  const auto gn = r.grads.named();
  // Random directions over all parameters, and over the DSpark heads alone (their share is small).
  for (int dirn = 0; dirn < 4; ++dirn) {
    DrafterWeights<double> delta = drafter_zeros<double>(p.cfg);
    auto dn = delta.named();
    double nrm = 0, an = 0;
    for (auto& [name, t] : dn) {
      const bool head = name.find("_head.") != std::string::npos;
      for (double& v : t->data) nrm += (v = dirn < 2 || head ? nd(rng) : 0.0) * v;
    }
    for (size_t i = 0; i < dn.size(); ++i)
      for (size_t j = 0; j < dn[i].second->data.size(); ++j)
        an += (dn[i].second->data[j] /= std::sqrt(nrm)) * gn[i].second->data[j];
    auto loss_at = [&](double h) {
      DrafterWeights<double> w2 = p.w;
      auto wn = w2.named();
      for (size_t i = 0; i < wn.size(); ++i)
        for (size_t j = 0; j < wn[i].second->data.size(); ++j) wn[i].second->data[j] += h * dn[i].second->data[j];
      return drafter_step(p.cfg, w2, p.seq, fwd).loss;
    };
    const double fd = test::central_difference(loss_at, 1e-4);
    const double rel = std::abs(fd - an) / std::max(std::abs(an), 1e-12);
    std::printf("[dspark fd] direction %d: analytic %+.12e fd %+.12e rel %.2e\n", dirn, an, fd, rel);
    EXPECT_LE(rel, 1e-6) << "direction " << dirn;
  }
}

TEST(DSpark, StepNeedsTheTargetHiddenStatesAndRefusesDpace) {
  Problem<double> p;
  p.seq.target_hidden = nullptr;
  EXPECT_THROW(drafter_step(p.cfg, p.w, p.seq), std::invalid_argument);
  Problem<double> q;
  q.seq.dpace = true;
  EXPECT_THROW(drafter_step(q.cfg, q.w, q.seq), std::invalid_argument);
}

TEST(DSpark, GreedyDraftsWalkAsTheTrainingForwardReadsThem) {
  // The walk feeds each drafted token to the Markov head of the next slot; the training forward
  // teacher-forces ids[a + k] there. With the ids after the anchor set to the walk's own tokens, each
  // slot's training logits must pick that same token.
  Problem<float> p(21);
  const int64_t a = 8, B = p.cfg.block_size;
  DrafterContextCache cache;
  drafter_extend_context(p.cfg, p.w, cache, slice_rows(p.taps, 0, a));
  const int32_t last = int32_t(p.seq.ids[size_t(a)]);
  const Tensor hb = drafter_draft_hidden(p.cfg, p.w, cache, last, p.embed);
  const std::vector<int32_t> drafts = dspark_greedy_drafts(p.w, hb, last, p.lm_head);
  ASSERT_EQ(int64_t(drafts.size()), B);
  DrafterSequence<float> seq = p.seq;
  Tensor taps = slice_rows(p.taps, 0, a + B + 1);
  seq.taps = &taps;
  seq.ids.assign(size_t(a + B + 1), 0);
  seq.ids[size_t(a)] = last;
  for (int64_t k = 0; k < B; ++k) seq.ids[size_t(a + k + 1)] = drafts[size_t(k)];
  seq.loss_mask.assign(seq.ids.size(), 1);
  Tensor g = slice_rows(p.g, 0, a + B + 1);
  seq.target_hidden = &g;
  seq.anchors = {a};
  seq.num_blocks = 1;
  DrafterStepOptions o;
  o.backward = false;
  o.keep_logits = true;
  const auto r = drafter_step(p.cfg, p.w, seq, o);
  const int64_t V = p.cfg.vocab_size;
  for (int64_t k = 0; k < B; ++k) {
    const float* z = r.logits.row(k);
    EXPECT_EQ(int32_t(std::max_element(z, z + V) - z), drafts[size_t(k)]) << "slot " << k;
  }
  EXPECT_THROW(dspark_greedy_drafts(p.w, hb, int32_t(V), p.lm_head), std::invalid_argument);
}

TEST(DSpark, ConfigAsSGLangAndVllmReadIt) {
  const DrafterConfig c = tiny_dspark();
  const nlohmann::json j = drafter_config_to_json(c);
  EXPECT_EQ(j["architectures"], nlohmann::json({"Qwen3DSparkModel"}));
  EXPECT_EQ(j["markov_rank"], 3);
  EXPECT_EQ(j["markov_head_type"], "vanilla");
  EXPECT_EQ(j["enable_confidence_head"], true);
  EXPECT_EQ(j["confidence_head_with_markov"], true);
  EXPECT_EQ(j["block_size"], 4);
  const DrafterConfig back = drafter_config_from_json(j, "config.json");
  EXPECT_EQ(back.markov_rank, 3);
  EXPECT_EQ(back.drafts_per_block(), 4);
  // SGLang's other places for the rank: dspark_config, then the dspark_ prefixed key first.
  nlohmann::json k = j;
  k.erase("markov_rank");
  k["dspark_config"] = {{"markov_rank", 5}};
  EXPECT_EQ(drafter_config_from_json(k, "c").markov_rank, 5);
  k["dspark_markov_rank"] = 6;
  EXPECT_EQ(drafter_config_from_json(k, "c").markov_rank, 6);
  // A DFlash config stays DFlash.
  nlohmann::json f = j;
  for (const char* key : {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"}) f.erase(key);
  EXPECT_FALSE(drafter_config_from_json(f, "c").is_dspark());
  EXPECT_EQ(drafter_config_from_json(f, "c").drafts_per_block(), 3);
  auto refused = [&](nlohmann::json bad, const std::string& words) {
    try {
      drafter_config_from_json(bad, "dspark/config.json");
      ADD_FAILURE() << "accepted: " << words;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("dspark/config.json"), std::string::npos) << e.what();
    }
  };
  nlohmann::json gated = j;
  gated["markov_head_type"] = "gated";
  refused(gated, "only the vanilla Markov head");
  nlohmann::json speculators = j;
  speculators["speculators_model_type"] = "dspark";
  refused(speculators, "speculators convention");
  nlohmann::json noconf = j;
  noconf["enable_confidence_head"] = false;
  refused(noconf, "enable_confidence_head");
  nlohmann::json notype = j;
  notype.erase("markov_head_type");
  refused(notype, "without markov_head_type");
}

TEST(DSpark, CheckpointRoundTripWithItsHeads) {
  Problem<float> p;
  const auto shapes = drafter_param_shapes(p.cfg);
  ASSERT_GE(shapes.size(), 4u);
  EXPECT_EQ(shapes[shapes.size() - 4].first, "markov_head.markov_w1.weight");
  EXPECT_EQ(shapes[shapes.size() - 4].second, (std::vector<int64_t>{37, 3}));
  EXPECT_EQ(shapes[shapes.size() - 3].second, (std::vector<int64_t>{37, 3}));
  EXPECT_EQ(shapes[shapes.size() - 2].first, "confidence_head.proj.weight");
  EXPECT_EQ(shapes[shapes.size() - 2].second, (std::vector<int64_t>{1, 19}));
  EXPECT_EQ(shapes.back().first, "confidence_head.proj.bias");
  test::TempDir dir;
  write_drafter_checkpoint((dir / "d").string(), p.cfg, p.w);
  DrafterConfig cfg;
  const DrafterWeights<float> w = load_drafter_weights<float>((dir / "d").string(), &cfg);
  EXPECT_EQ(cfg.markov_rank, 3);
  const auto a = std::as_const(p.w).named();
  const auto b = w.named();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {  // stored as bf16
    std::vector<float> rounded = a[i].second->data;
    for (float& x : rounded) x = bf16_to_f32(f32_to_bf16(x));
    EXPECT_EQ(rounded, b[i].second->data) << a[i].first;
  }
  const std::string serve = serving_commands("Qwen/Qwen3-8B", "out/final", p.cfg);
  EXPECT_NE(serve.find("--speculative-algorithm DSPARK"), std::string::npos) << serve;
  EXPECT_NE(serve.find("--speculative-num-draft-tokens 5"), std::string::npos) << serve;  // block 4 + 1
  EXPECT_NE(serve.find("\"method\":\"dspark\""), std::string::npos) << serve;
  EXPECT_NE(serve.find("\"num_speculative_tokens\":4"), std::string::npos) << serve;
}
