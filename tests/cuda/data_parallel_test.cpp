// Data-parallel GPU training (make_gpu_backend with two devices) against one GPU: the same steps
// on the same data from the same initial weights. Needs two CUDA devices (scripts/gpu_check.sh on
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

  auto run = [&](const std::vector<int>& gpus, std::vector<double>* losses) {
    DrafterTrainer tr(cfg, make_gpu_backend(cfg, w0, target, gpus), int64_t(data.size()), o);
    for (int i = 0; i < 4; ++i) {
      const TrainStepStats st = tr.step(source);
      EXPECT_FALSE(st.skipped);
      EXPECT_EQ(st.micro_batches, 4);
      losses->push_back(st.loss);
    }
    EXPECT_EQ(tr.backend().device(), gpus.size() == 1 ? "cuda:0" : "cuda:0,1");
    return tr.backend().state().weights;
  };
  std::vector<double> l1, l2;
  const DrafterWeights<float> w1 = run({0}, &l1), w2 = run({0, 1}, &l2);
  // Step 1 runs the same micro-batches on the same weights with the same kernels: the same losses.
  EXPECT_EQ(l1[0], l2[0]);
  // Afterwards only the order of the gradient sum differs (one GPU accumulates 1+2+3+4, two GPUs
  // (1+3)+(2+4)): fp32 rounding, amplified a little by AdamW's normalization.
  for (size_t i = 1; i < l1.size(); ++i) EXPECT_NEAR(l2[i], l1[i], 1e-4 * std::abs(l1[i])) << "step " << i + 1;
  const auto a = w1.named(), b = w2.named();
  std::vector<double> x, y;
  for (size_t i = 0; i < a.size(); ++i) {
    x.insert(x.end(), a[i].second->data.begin(), a[i].second->data.end());
    y.insert(y.end(), b[i].second->data.begin(), b[i].second->data.end());
  }
  const double e = test::rel_l2(y, x);
  EXPECT_LE(e, 1e-4);
  std::printf("[data parallel] losses 1 GPU %.6f %.6f %.6f %.6f | 2 GPUs %.6f %.6f %.6f %.6f | weights rel L2 %.2e\n",
              l1[0], l1[1], l1[2], l1[3], l2[0], l2[1], l2[2], l2[3], e);
}

#endif  // DFLASH_HAVE_CUDA
