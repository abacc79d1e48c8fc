// The CPU drafter training loop: bitwise resume (6 steps == 3 + save + load + 3), gradient
// accumulation, empty examples, refusals, and that training lowers the loss.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "io/safetensors.h"
#include "models/drafter_checkpoint.h"
#include "test_util.h"
#include "train/anchors.h"
#include "train/trainer.h"

using namespace dflash;

namespace {

std::filesystem::path fixture() { return test::fixtures_dir() / "drafter"; }

/// The tiny drafter of tests/fixtures/drafter (d 48, 3 taps, vocab 97, B 4, a sliding layer) and
/// synthetic examples: random ids and taps, loss on the "response" part with a hole, one example
/// without any anchor candidate.
struct TinyRun {
  DrafterConfig cfg;
  Tensor embed, lm_head;
  std::vector<TrainSample> examples;
  std::vector<Tensor> taps;  // per example: what a target would give

  TinyRun() {
    load_drafter_weights<float>((fixture() / "init").string(), &cfg);
    const SafetensorsFile in((fixture() / "inputs.safetensors").string());
    embed = test::read_tensor<float>(in, "embed_tokens");
    lm_head = test::read_tensor<float>(in, "lm_head");
    std::mt19937_64 rng(42);
    std::normal_distribution<float> nd;
    const int64_t kd = cfg.hidden_size * int64_t(cfg.target_layer_ids.size());
    for (int64_t e = 0; e < 5; ++e) {
      TrainSample ex;
      const int64_t S = 14 + 4 * e;
      for (int64_t p = 0; p < S; ++p) {
        ex.ids.push_back(int64_t(rng() % 90));
        ex.loss_mask.push_back(e == 3 ? 0 : uint8_t(p >= 5 && p != S - 4));
      }
      Tensor t({S, kd});
      for (float& x : t.data) x = nd(rng);
      examples.push_back(std::move(ex));
      taps.push_back(std::move(t));
    }
  }
  SampleSource source() const {
    return [this](int64_t i) { return examples.at(size_t(i)); };
  }
  TapsFn taps_fn() const {
    return [this](const TrainSample& s) { return taps.at(size_t(s.index)); };
  }
  std::unique_ptr<DrafterBackend> backend(uint64_t init_seed, TapsFn t = {}) const {
    return make_cpu_backend(cfg, init_drafter_weights(cfg, init_seed), &embed, &lm_head, t ? t : taps_fn());
  }
  TrainerOptions options() const {
    TrainerOptions o;
    o.num_anchors = 3;
    o.grad_accum = 2;
    o.gamma = 2.0;
    o.schedule.peak_lr = 1e-3;
    o.schedule.total_steps = 6;
    o.schedule.warmup_ratio = 0.34;  // 3 warmup steps: the resume point sits at the schedule's corner
    o.seed = 1234;
    return o;
  }
  DrafterTrainer trainer(uint64_t init_seed = 7) const {
    return DrafterTrainer(cfg, backend(init_seed), int64_t(examples.size()), options());
  }
};

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void expect_same_state(const DrafterTrainer& a, const DrafterTrainer& b) {
  const OptimizerState sa = a.backend().state(), sb = b.backend().state();
  const auto na = sa.weights.named(), nb = sb.weights.named();
  ASSERT_EQ(na.size(), nb.size());
  EXPECT_EQ(sa.step, sb.step);
  for (size_t i = 0; i < na.size(); ++i) {
    EXPECT_TRUE(same_bits(na[i].second->data, nb[i].second->data)) << "weights " << na[i].first;
    EXPECT_TRUE(same_bits(sa.exp_avg[i], sb.exp_avg[i])) << "exp_avg " << na[i].first;
    EXPECT_TRUE(same_bits(sa.exp_avg_sq[i], sb.exp_avg_sq[i])) << "exp_avg_sq " << na[i].first;
  }
  EXPECT_EQ(a.step_count(), b.step_count());
  EXPECT_EQ(a.position().epoch, b.position().epoch);
  EXPECT_EQ(a.position().index, b.position().index);
}

}  // namespace

TEST(Trainer, ResumeIsBitwiseExact) {
  const TinyRun s;
  DrafterTrainer full = s.trainer();
  std::vector<TrainStepStats> want;
  for (int i = 0; i < 6; ++i) want.push_back(full.step(s.source()));
  // 12 micro-batches over 5 examples: the run crosses two epoch boundaries, and meets the example
  // without anchor candidates (index 3) at least twice.
  EXPECT_EQ(full.position().epoch, 2);
  int64_t empty = 0;
  for (const auto& st : want) empty += st.empty_micro_batches;
  EXPECT_GE(empty, 2);

  test::TempDir td;
  const std::string ckpt = (td / "step3").string();
  DrafterTrainer first = s.trainer();
  for (int i = 0; i < 3; ++i) {
    const TrainStepStats st = first.step(s.source());
    EXPECT_EQ(st.loss, want[size_t(i)].loss) << "step " << i + 1;
  }
  first.save(ckpt);
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(ckpt) / kTrainingStateFile));

  DrafterTrainer resumed = s.trainer(/*init_seed=*/99);  // different weights: all must come from the file
  resumed.resume(ckpt);
  expect_same_state(resumed, first);
  for (int i = 3; i < 6; ++i) {
    const TrainStepStats st = resumed.step(s.source());
    EXPECT_EQ(st.loss, want[size_t(i)].loss) << "step " << i + 1;
    EXPECT_EQ(st.grad_norm, want[size_t(i)].grad_norm) << "step " << i + 1;
    EXPECT_EQ(st.lr, want[size_t(i)].lr) << "step " << i + 1;
    EXPECT_EQ(st.slot_correct, want[size_t(i)].slot_correct) << "step " << i + 1;
  }
  expect_same_state(resumed, full);

  // The servable model.safetensors is the bf16 rounding of the fp32 masters.
  const auto served = load_drafter_weights<float>(ckpt, nullptr);
  const OptimizerState fs = first.backend().state();
  const auto sn = served.named();
  const auto fn = fs.weights.named();
  for (size_t i = 0; i < sn.size(); ++i)
    for (size_t j = 0; j < sn[i].second->data.size(); ++j)
      ASSERT_EQ(sn[i].second->data[j], bf16_to_f32(f32_to_bf16(fn[i].second->data[j]))) << sn[i].first;
}

TEST(Trainer, GradientAccumulationAveragesMicroBatches) {
  // One step over examples {a, b} with grad_accum 2 moves the weights as one step on the averaged
  // gradient: check it through the first AdamW moment, m = (1 - beta1) * clipped mean gradient.
  TinyRun s;
  s.examples.resize(2);
  TrainerOptions o = s.options();
  o.shuffle = false;
  o.max_grad_norm = 1e9;  // no clipping
  const DrafterWeights<float> w0 = init_drafter_weights(s.cfg, 7);
  DrafterTrainer t(s.cfg, s.backend(7), 2, o);
  t.step(s.source());
  // Reproduce the anchors: the trainer's RNG starts from the seed and draws per example in order.
  std::mt19937_64 rng(o.seed);
  DrafterGrads<double> mean = drafter_zeros<double>(s.cfg);
  for (int e = 0; e < 2; ++e) {
    const TrainSample& ex = s.examples[size_t(e)];
    DrafterSequence<float> seq;
    seq.taps = &s.taps[size_t(e)];
    seq.ids = ex.ids;
    seq.loss_mask.assign(ex.loss_mask.begin(), ex.loss_mask.end());
    seq.anchors = sample_anchors(ex.loss_mask, o.num_anchors, rng);
    seq.num_blocks = int64_t(seq.anchors.size());
    seq.embed = &s.embed;
    seq.lm_head = &s.lm_head;
    seq.gamma = o.gamma;
    const auto r = drafter_step(s.cfg, w0, seq);
    auto mn = mean.named();
    const auto gn = r.grads.named();
    for (size_t i = 0; i < mn.size(); ++i)
      for (size_t j = 0; j < mn[i].second->data.size(); ++j) mn[i].second->data[j] += 0.5 * gn[i].second->data[j];
  }
  const auto mn = mean.named();
  for (size_t i = 0; i < mn.size(); ++i) {
    std::vector<double> want(mn[i].second->data.size());
    for (size_t j = 0; j < want.size(); ++j) want[j] = (1 - o.adamw.beta1) * mn[i].second->data[j];
    EXPECT_LE(test::rel_l2(t.backend().state().exp_avg[i], want), 1e-6) << mn[i].first;
  }
}

TEST(Trainer, TrainingLowersTheLoss) {
  const TinyRun s;
  TrainerOptions o = s.options();
  o.schedule.total_steps = 60;
  o.schedule.warmup_ratio = 0.04;
  o.schedule.peak_lr = 3e-3;
  o.num_anchors = 8;
  DrafterTrainer t(s.cfg, s.backend(7), int64_t(s.examples.size()), o);
  double first = 0, last = 0;
  for (int i = 0; i < 60; ++i) {
    const TrainStepStats st = t.step(s.source());
    ASSERT_FALSE(st.skipped && st.empty_micro_batches < st.micro_batches) << "step " << i;
    if (i < 10) first += st.loss / 10;
    if (i >= 50) last += st.loss / 10;
  }
  std::printf("[trainer] mean loss steps 1-10 %.4f, steps 51-60 %.4f\n", first, last);
  EXPECT_LT(last, 0.5 * first);
}

// NaN in one example's taps: that step is skipped and names the example and a gradient tensor;
// the weights stay finite and the following steps train.
TEST(Trainer, NonFiniteTapsSkipTheStepNamingExampleAndTensor) {
  // (Past the first kTapCheckedMicroBatches micro-batches, whose taps the backend checks: a NaN there
  // stops the run, TapsOfTheFirstMicroBatchesStopTheRun.)
  const TinyRun run;
  const int64_t bad = 4;
  TapsFn poisoned = [&](const TrainSample& s) {
    Tensor t = run.taps.at(size_t(s.index));
    if (s.index == bad) t.data[5] = std::nanf("");
    return t;
  };
  TrainerOptions o = run.options();
  o.shuffle = false;  // examples in order: step 3 holds examples 4 and 0 (the 5th and 6th micro-batches)
  DrafterTrainer tr(run.cfg, run.backend(7, poisoned), int64_t(run.examples.size()), o);
  int skipped = 0;
  for (int i = 0; i < 5; ++i) {
    const TrainStepStats st = tr.step(run.source());
    if (!st.skipped) {
      EXPECT_TRUE(st.nonfinite.empty()) << st.nonfinite;
      continue;
    }
    ++skipped;
    EXPECT_NE(st.nonfinite.find("non-finite taps in example 4"), std::string::npos) << st.nonfinite;
    EXPECT_NE(st.nonfinite.find("the gradient of "), std::string::npos) << st.nonfinite;
  }
  EXPECT_GE(skipped, 1);
  EXPECT_TRUE(first_nonfinite(tr.backend().state().weights).empty());
}

TEST(Trainer, TapsOfTheFirstMicroBatchesStopTheRun) {
  const TinyRun run;
  TapsFn poisoned = [&](const TrainSample& s) {
    Tensor t = run.taps.at(size_t(s.index));
    if (s.index == 1) t.data[5] = std::nanf("");
    return t;
  };
  TrainerOptions o = run.options();
  o.shuffle = false;
  DrafterTrainer tr(run.cfg, run.backend(7, poisoned), int64_t(run.examples.size()), o);
  try {
    tr.step(run.source());
    FAIL() << "NaN taps were trained on";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("training example 1: the target's taps are unusable: target layer " +
                     std::to_string(run.cfg.target_layer_ids[0]) + ": 1 of"), std::string::npos) << m;
  }
  EXPECT_EQ(tr.step_count(), 0);
  EXPECT_EQ(tr.position().index, 0);  // nothing consumed
  DrafterTrainer ok(run.cfg, run.backend(7), int64_t(run.examples.size()), o);
  const TrainStepStats st = ok.step(run.source());
  ASSERT_EQ(st.tap_stats.size(), 2u);  // both micro-batches of the first step were checked
  EXPECT_EQ(st.tap_stats[0].first, 0);
  EXPECT_GT(st.tap_stats[0].second.at(0).rms, 0.5);
}

TEST(Trainer, BadExamplesAndMismatchedResumesAreRefused) {
  const TinyRun s;
  DrafterTrainer t = s.trainer();
  TapsFn bad = [&](const TrainSample& x) { return x.index == 1 ? Tensor({3, 3}) : s.taps.at(size_t(x.index)); };
  TrainerOptions o = s.options();
  o.shuffle = false;
  DrafterTrainer ordered(s.cfg, s.backend(7, bad), 5, o);
  try {
    ordered.step(s.source());
    FAIL() << "a bad example was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("training example 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("taps"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ordered.position().index, 0);  // nothing consumed
  EXPECT_EQ(ordered.step_count(), 0);

  test::TempDir td;
  const std::string ckpt = (td / "ckpt").string();
  t.step(s.source());
  t.save(ckpt);
  DrafterTrainer fewer(s.cfg, s.backend(7), 4, s.options());
  EXPECT_THROW(fewer.resume(ckpt), std::runtime_error);
  TrainerOptions other_seed = s.options();
  other_seed.seed = 5;
  DrafterTrainer seeded(s.cfg, s.backend(7), 5, other_seed);
  EXPECT_THROW(seeded.resume(ckpt), std::runtime_error);
  DrafterTrainer fine = s.trainer();
  EXPECT_THROW(fine.resume((td / "nothing").string()), std::runtime_error);
  std::filesystem::remove(std::filesystem::path(ckpt) / kTrainingStateFile);
  try {
    fine.resume(ckpt);
    FAIL() << "resumed without a training state";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(kTrainingStateFile), std::string::npos) << e.what();
  }
}

TEST(Trainer, InitFollowsQwen3Defaults) {
  const TinyRun s;
  const auto a = init_drafter_weights(s.cfg, 3), b = init_drafter_weights(s.cfg, 3), c = init_drafter_weights(s.cfg, 4);
  const auto an = a.named(), bn = b.named(), cn = c.named();
  double sum = 0, sq = 0;
  int64_t n = 0;
  for (size_t i = 0; i < an.size(); ++i) {
    EXPECT_EQ(an[i].second->data, bn[i].second->data) << an[i].first;
    if (an[i].second->ndim() == 1) {
      for (float x : an[i].second->data) EXPECT_EQ(x, 1.0f) << an[i].first;
      continue;
    }
    EXPECT_NE(an[i].second->data, cn[i].second->data) << an[i].first;
    for (float x : an[i].second->data) {
      sum += x;
      sq += double(x) * x;
      ++n;
    }
  }
  const double mean = sum / double(n), sd = std::sqrt(sq / double(n) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 5e-4);
  EXPECT_NEAR(sd, 0.02, 5e-4);
}
