// Multi-GPU training (make_gpu_backend: disaggregated target / drafter GPUs, two target replicas,
// data-parallel drafter replicas) against one GPU: the same steps on the same data from the same
// initial weights. Needs two CUDA devices (scripts/gpu_check.sh on
// the 2-GPU machine); skipped, saying so, with fewer.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <random>

#include "gpu/runtime.h"
#include "models/drafter_config.h"
#include "models/target.h"
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

/// The qwen3_hd64 target, a 2-layer drafter, 8 samples and trainer options (4 micro-batches a step).
struct TinySetup {
  std::unique_ptr<TargetModel> model = TargetModel::load((test::fixtures_dir() / "qwen3_hd64").string());
  DrafterConfig cfg;
  DrafterWeights<float> w0;
  std::vector<TrainSample> data;
  TrainerOptions o;
  TinySetup() {
    DrafterOverrides ov;
    ov.num_hidden_layers = 2, ov.block_size = 4, ov.num_taps = 1, ov.mask_token_id = model->spec().vocab_size - 1;
    cfg = derive_drafter_config(model->spec(), nullptr, ov);
    w0 = init_drafter_weights(cfg, 5);
    data = samples(model->spec().vocab_size, 8);
    o.num_anchors = 6, o.grad_accum = 4, o.seed = 3;
    o.schedule = {3e-3, 4, 0.0};
  }
  /// 4 steps on these GPUs: the losses, and the final weights flattened.
  std::vector<double> run(const std::vector<int>& tg, const std::vector<int>& dg, int64_t pack_tokens,
                          const std::string& device, std::vector<double>* losses) const {
    const SampleSource source = [&](int64_t i) { return data.at(size_t(i)); };
    DrafterTrainer tr(cfg, make_gpu_backend(cfg, w0, *model, tg, dg, GpuTrainOptions{false, pack_tokens, TargetDtype::kBf16, {}}),
                      int64_t(data.size()), o);
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
  }
};

}  // namespace

TEST(CudaDataParallel, PackedTargetForwardsTrainLikeOneByOne) {
  if (device_count() < 1) GTEST_SKIP() << "no CUDA device visible: skipped";
  const TinySetup u;
  std::vector<double> l1, lp;
  u.run({0}, {0}, 1, "cuda:0", &l1);      // one target forward per sample
  u.run({0}, {0}, 8192, "cuda:0", &lp);   // the step's 4 samples in one varlen forward
  // The same math; only the attention's key tiles group differently (fp32 sums, bf16 taps).
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(lp[i], l1[i], 2e-3 * std::abs(l1[i])) << "step " << i + 1;
  std::printf("[packed target] losses one by one %.6f %.6f %.6f %.6f | packed %.6f %.6f %.6f %.6f\n", l1[0], l1[1],
              l1[2], l1[3], lp[0], lp[1], lp[2], lp[3]);
}

TEST(CudaDataParallel, TwoGpusTrainLikeOne) {
  if (device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices (found " << device_count() << "): skipped";
  const TinySetup u;
  std::vector<double> l1, l2, l3, l4, l5, l6;
  // One target forward per sample (pack 1), so that every placement computes the same taps.
  const auto w1 = u.run({0}, {0}, 1, "cuda:0", &l1);
  // One drafter replica fed from another GPU (or from two): the same kernels on the same taps in
  // the same order, so bitwise the same training.
  const auto w3 = u.run({0}, {1}, 1, "target cuda:0 / drafter cuda:1", &l3);
  const auto w4 = u.run({0, 1}, {0}, 1, "target cuda:0,1 / drafter cuda:0", &l4);
  EXPECT_EQ(l3, l1);
  EXPECT_EQ(l4, l1);
  EXPECT_EQ(w3, w1);
  EXPECT_EQ(w4, w1);
  // Packed forwards: disaggregated equals one GPU bitwise too (one target replica packs the same runs).
  const auto w5 = u.run({0}, {0}, 8192, "cuda:0", &l5);
  const auto w6 = u.run({0}, {1}, 8192, "target cuda:0 / drafter cuda:1", &l6);
  EXPECT_EQ(l6, l5);
  EXPECT_EQ(w6, w5);
  // Two drafter replicas (data parallel). Step 1 runs the same micro-batches on the same weights
  // with the same kernels: the same loss. Afterwards only the order of the gradient sum differs (one
  // GPU accumulates all four, two GPUs two each, then the all-reduce): fp32 rounding, amplified a
  // little by AdamW.
  const auto w2 = u.run({0, 1}, {0, 1}, 1, "cuda:0,1", &l2);
  EXPECT_EQ(l1[0], l2[0]);
  for (size_t i = 1; i < l1.size(); ++i) EXPECT_NEAR(l2[i], l1[i], 1e-4 * std::abs(l1[i])) << "step " << i + 1;
  const double e = test::rel_l2(w2, w1);
  EXPECT_LE(e, 1e-4);
  const bool same = l3 == l1 && w3 == w1 && l4 == l1 && w4 == w1 && l6 == l5 && w6 == w5;
  std::printf("[data parallel] losses 1 GPU %.6f %.6f %.6f %.6f | 2 GPUs %.6f %.6f %.6f %.6f | weights rel L2 %.2e; "
              "disaggregated runs bitwise equal to one GPU: %s\n",
              l1[0], l1[1], l1[2], l1[3], l2[0], l2[1], l2[2], l2[3], e, same ? "yes" : "NO");
}

#endif  // DFLASH_HAVE_CUDA
