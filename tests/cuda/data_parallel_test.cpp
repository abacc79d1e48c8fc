// Multi-GPU training (make_gpu_backend: disaggregated target / drafter GPUs, two target replicas,
// data-parallel drafter replicas) against one GPU: the same steps on the same data from the same
// initial weights. Needs two CUDA devices (scripts/gpu_check.sh on
// the 2-GPU machine); skipped, saying so, with fewer.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <random>

#include "models/drafter_config.h"
#include "models/target.h"
#include "ops/cuda/runtime.h"
#include "test_util.h"
#include "train/cuda/gpu_backend.h"
#include "train/trainer.h"

using namespace dflash;

namespace {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

/// Random chat-like samples for a vocabulary of `V` (loss on the second half).
std::vector<TrainSample> samples(int64_t V, int n) {
  std::mt19937_64 rng(11);
  std::vector<TrainSample> r;
  for (int e = 0; e < n; ++e) {
    TrainSample s;
    const int64_t S = 40 + 7 * e;
    for (int64_t t = 0; t < S; ++t) {
      s.ids.push_back(int64_t(rng() % uint64_t(V - 2)));
      s.loss_mask.push_back(t >= S / 2);
    }
    r.push_back(std::move(s));
  }
  return r;
}

}  // namespace

TEST(CudaDataParallel, TwoGpusTrainLikeOne) {
  if (device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices (found " << device_count() << "): skipped";
  const auto model = TargetModel::load((test::fixtures_dir() / "qwen3_hd64").string());
  const TargetModel& target = *model;
  DrafterOverrides ov;
  ov.num_hidden_layers = 2, ov.block_size = 4, ov.num_taps = 1, ov.mask_token_id = target.spec().vocab_size - 1;
  const DrafterConfig cfg = derive_drafter_config(target.spec(), nullptr, ov);
  const DrafterWeights<float> w0 = init_drafter_weights(cfg, 5);
  const std::vector<TrainSample> data = samples(target.spec().vocab_size, 8);
  const SampleSource source = [&](int64_t i) { return data.at(size_t(i)); };
  TrainerOptions o;
  o.num_anchors = 6, o.grad_accum = 4, o.seed = 3;
  o.schedule = {3e-3, 4, 0.0};

  auto run = [&](const std::vector<int>& tg, const std::vector<int>& dg, const std::string& device,
                 std::vector<double>* losses) {
    DrafterTrainer tr(cfg, make_gpu_backend(cfg, w0, target, tg, dg), int64_t(data.size()), o);
    for (int i = 0; i < 4; ++i) {
      const TrainStepStats st = tr.step(source);
      EXPECT_FALSE(st.skipped);
      EXPECT_EQ(st.micro_batches, 4);
      losses->push_back(st.loss);
    }
    EXPECT_EQ(tr.backend().device(), device);
    const OptimizerState st = tr.backend().state();
    std::vector<double> flat;
    for (const auto& [name, t] : st.weights.named()) flat.insert(flat.end(), t->data.begin(), t->data.end());
    return flat;
  };
  std::vector<double> l1, l2, l3, l4;
  const auto w1 = run({0}, {0}, "cuda:0", &l1);
  // One drafter replica fed from another GPU (or from two): the same kernels on the same taps in
  // the same order, so bitwise the same training.
  const auto w3 = run({0}, {1}, "target cuda:0 / drafter cuda:1", &l3);
  const auto w4 = run({0, 1}, {0}, "target cuda:0,1 / drafter cuda:0", &l4);
  EXPECT_EQ(l3, l1);
  EXPECT_EQ(l4, l1);
  EXPECT_EQ(w3, w1);
  EXPECT_EQ(w4, w1);
  // Two drafter replicas (data parallel). Step 1 runs the same micro-batches on the same weights
  // with the same kernels: the same loss. Afterwards only the order of the gradient sum differs (one
  // GPU accumulates 1+2+3+4, two GPUs (1+3)+(2+4)): fp32 rounding, amplified a little by AdamW.
  const auto w2 = run({0, 1}, {0, 1}, "cuda:0,1", &l2);
  EXPECT_EQ(l1[0], l2[0]);
  for (size_t i = 1; i < l1.size(); ++i) EXPECT_NEAR(l2[i], l1[i], 1e-4 * std::abs(l1[i])) << "step " << i + 1;
  const double e = test::rel_l2(w2, w1);
  EXPECT_LE(e, 1e-4);
  std::printf("[data parallel] losses 1 GPU %.6f %.6f %.6f %.6f | 2 GPUs %.6f %.6f %.6f %.6f | weights rel L2 %.2e; "
              "disaggregated runs bitwise equal to one GPU: %s\n",
              l1[0], l1[1], l1[2], l1[3], l2[0], l2[1], l2[2], l2[3], e, (l3 == l1 && w3 == w1 && l4 == l1 && w4 == w1) ? "yes" : "NO");
}

#endif  // DFLASH_HAVE_CUDA
