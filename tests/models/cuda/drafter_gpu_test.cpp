// The GPU drafter step (bf16 compute, fp32 masters / gradients) against the CPU reference step
// (fp32) on the same bf16-representable weights and inputs: loss, per-slot accuracy counts, every
// parameter gradient, gradient accumulation, and one fused clip + AdamW step.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <cmath>
#include <random>

#include "models/cuda/drafter_gpu.h"
#include "ops/cuda/cross_entropy.h"
#include "models/drafter.h"
#include "tensor/dtype.h"
#include "cuda_test_util.h"
#include "test_util.h"
#include "train/trainer.h"

using namespace dflash;

using CudaDrafter = test::GpuTest;

namespace {


float bf(float x) { return bf16_to_f32(f32_to_bf16(x)); }

struct Tiny {
  DrafterConfig cfg;
  DrafterWeights<float> w;
  Tensor taps, embed, lm_head, target_hidden;
  DrafterSequence<float> seq;

  /// `t` on the device, bf16 (the values are bf16 already): the taps, the target's hidden states.
  static cuda::DeviceArray<cuda::bf16> on_device(const Tensor& t) {
    std::vector<uint16_t> tb(t.data.size());
    for (size_t i = 0; i < tb.size(); ++i) tb[i] = f32_to_bf16(t.data[i]);
    cuda::DeviceArray<cuda::bf16> d(tb.size());
    DFLASH_CUDA_CHECK(cudaMemcpy(d.data(), tb.data(), tb.size() * 2, cudaMemcpyHostToDevice));
    return d;
  }
  cuda::DeviceArray<cuda::bf16> device_taps() const { return on_device(taps); }
  /// scaled: yarn RoPE (factor 4 over a pretrained length of 8192) and every layer causal in its block
  /// (dflash_config.causal), the semantics servers read from published configs.
  /// dspark: a DSpark drafter (Markov rank 16) with the target's final hidden states.
  explicit Tiny(bool scaled = false, bool dspark = false) {
    if (dspark) cfg.markov_rank = 16;
    if (scaled) {
      cfg.rope.type = "yarn", cfg.rope.factor = 4.0, cfg.rope.original_max_position_embeddings = 8192;
      cfg.causal = true;
    }
    cfg.hidden_size = 128, cfg.intermediate_size = 192, cfg.num_hidden_layers = 2;
    cfg.num_attention_heads = 4, cfg.num_key_value_heads = 2, cfg.head_dim = 64;
    cfg.rope.theta = 1e4, cfg.vocab_size = 300, cfg.block_size = 4, cfg.num_target_layers = 8;
    cfg.target_layer_ids = {1, 3, 5};
    cfg.mask_token_id = 299;
    cfg.layer_types = {"sliding_attention", "full_attention"};
    cfg.sliding_window = 6;
    cfg.validate("tiny");
    w = init_drafter_weights(cfg, 11, 0.08);
    std::mt19937_64 rng(12);
    std::normal_distribution<float> nd;
    for (auto& [name, t] : w.named())
      for (float& x : t->data) x = bf(t->ndim() == 1 ? 1.f + 0.2f * nd(rng) : x);
    const int64_t S = 40, d = cfg.hidden_size, V = cfg.vocab_size;
    taps = Tensor({S, 3 * d});
    for (float& x : taps.data) x = bf(nd(rng));
    embed = Tensor({V, d});
    lm_head = Tensor({V, d});
    for (float& x : embed.data) x = bf(nd(rng));
    for (float& x : lm_head.data) x = bf(0.2f * nd(rng));
    for (int64_t p = 0; p < S; ++p) {
      seq.ids.push_back(int64_t(rng() % 290));
      seq.loss_mask.push_back(p >= 1 && p != 12 && p != 20);
    }
    seq.anchors = {2, 9, 15, 30, 38};  // 38: the block runs past the sequence
    seq.num_blocks = 6;                // one padding block
    seq.gamma = 2.0;
    seq.taps = &taps, seq.embed = &embed, seq.lm_head = &lm_head;
    if (dspark) {
      for (float& x : w.markov_w2.data) x = bf(0.3f * nd(rng));  // (init leaves W2 and the bias at 0)
      w.confidence_b.data[0] = 0.2f;
      target_hidden = Tensor({S, d});
      for (float& x : target_hidden.data) x = bf(nd(rng));
      seq.target_hidden = &target_hidden;
      seq.gamma = 4.0;
      // More blocks: over 16 weighted rows, so that the loss runs in two row chunks (16 rows the least).
      seq.anchors = {2, 5, 9, 15, 22, 26, 30, 38};
      seq.num_blocks = 9;
    }
  }
};

}  // namespace

TEST(CudaCrossEntropy, RowChunksFitTheLogitsBudgetInWholeTiles) {
  // (No GPU needed.) 1 GB of fp32 logits at V 248320 holds 1072 rows.
  const int64_t V = 248320;
  EXPECT_EQ(cuda::cross_entropy_row_chunk(V, 1000), 1000);  // fits: one chunk of all rows
  EXPECT_EQ(cuda::cross_entropy_row_chunk(V, 1072), 1072);
  EXPECT_EQ(cuda::cross_entropy_row_chunk(V, 4096), 1024);  // 4 chunks of 1024, not 3 x 1072 + 880
  EXPECT_EQ(cuda::cross_entropy_row_chunk(V, 7666), 1024);  // 8 chunks: 7 x 1024 + 498
  EXPECT_EQ(cuda::cross_entropy_row_chunk(V, 2100), 1056);  // 2 x 1050 -> 1152 > 1072: rounded to 16 only
  EXPECT_EQ(cuda::cross_entropy_row_chunk(300, 24, 7 * 300 * 4), 16);  // at least 16 rows
  for (int64_t rows : {1, 17, 1073, 5000, 100000}) {
    const int64_t rc = cuda::cross_entropy_row_chunk(V, rows);
    EXPECT_TRUE(rc == rows || (rc <= 1072 && rc % 16 == 0)) << rows;
    EXPECT_EQ((rows + rc - 1) / rc, (rows + 1071) / 1072) << "the fewest chunks that fit, rows " << rows;
  }
  EXPECT_THROW(cuda::cross_entropy_row_chunk(V, 0), std::invalid_argument);
  EXPECT_THROW(cuda::cross_entropy_row_chunk(0, 10), std::invalid_argument);
}

namespace {
/// One GPU step of `t` (ce_chunk_bytes: several row chunks) against the CPU reference's loss, weight
/// sum and every gradient (bf16 step tolerance).
void expect_step_matches_the_cpu(const Tiny& t) {
  const DrafterStepResult<float> ref = drafter_step(t.cfg, t.w, t.seq);
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    DrafterGpu gpu(t.cfg, t.w, t.embed, t.lm_head, s);
    const cuda::DeviceArray<cuda::bf16> taps = t.device_taps();
    const cuda::DeviceArray<cuda::bf16> hidden = Tiny::on_device(t.target_hidden);
    DrafterGpuStepOptions opt;
    opt.ce_chunk_bytes = 7 * 300 * 4;  // several row chunks (DSpark: 10 V bytes a row, at least 16 rows)
    const DrafterGpuSequence seq{taps.data(), t.seq.ids, t.seq.loss_mask, t.seq.anchors, t.seq.num_blocks,
                                 t.seq.gamma, t.seq.dpace, t.seq.target_hidden ? hidden.data() : nullptr};
    // Twice without zero_grads (the gradients add), then again after it (they start over): the
    // DSpark heads' atomics and GEMM follow the same accumulation as every other gradient.
    for (int round = 0; round < 3; ++round) {
      if (round == 2) gpu.zero_grads();
      const DrafterGpuStepResult r = gpu.step(seq, opt);
      EXPECT_LE(std::abs(r.loss - double(ref.loss)) / std::abs(double(ref.loss)), 1e-2);
      EXPECT_LE(std::abs(r.weight_sum - double(ref.weight_sum)) / double(ref.weight_sum), 1e-2);
      for (size_t k = 0; k < r.slot_count.size(); ++k) EXPECT_EQ(r.slot_count[k], ref.slot_count[k]) << "slot " << k;
      if (round == 0) continue;
      const float times = round == 1 ? 2.f : 1.f;
      const auto g = gpu.grads();
      const auto gn = g.named(), rn = ref.grads.named();
      ASSERT_EQ(gn.size(), rn.size());
      for (size_t i = 0; i < gn.size(); ++i) {
        std::vector<float> want = rn[i].second->data;
        for (float& x : want) x *= times;
        EXPECT_LE(test::rel_l2(gn[i].second->data, want), test::kTolBf16DrafterStep) << gn[i].first << " round " << round;
      }
    }
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}
}  // namespace

TEST_F(CudaDrafter, YarnAndCausalLayersMatchTheCpuReference) {
  const Tiny t(true), plain;
  // (The reference itself changes with both: the yarn frequencies and cos / sin scale, the block mask.)
  EXPECT_GT(std::abs(double(drafter_step(t.cfg, t.w, t.seq).loss) - double(drafter_step(plain.cfg, plain.w, plain.seq).loss)),
            1e-4);
  expect_step_matches_the_cpu(t);
}

TEST_F(CudaDrafter, DsparkStepMatchesTheCpuReference) {
  const Tiny t(false, true);
  ASSERT_TRUE(t.cfg.is_dspark());
  expect_step_matches_the_cpu(t);
  // A DSpark step needs the target's hidden states.
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    DrafterGpu gpu(t.cfg, t.w, t.embed, t.lm_head, s);
    const cuda::DeviceArray<cuda::bf16> taps = t.device_taps();
    EXPECT_THROW(gpu.step({taps.data(), t.seq.ids, t.seq.loss_mask, t.seq.anchors, t.seq.num_blocks, t.seq.gamma}),
                 std::invalid_argument);
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST_F(CudaDrafter, DpaceStepMatchesTheCpuReference) {
  Tiny t;
  t.seq.dpace = true;
  expect_step_matches_the_cpu(t);
}

TEST_F(CudaDrafter, StepMatchesTheCpuReference) {
  Tiny t;
  const DrafterStepResult<float> ref = drafter_step(t.cfg, t.w, t.seq);
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    DrafterGpu gpu(t.cfg, t.w, t.embed, t.lm_head, s);
    const cuda::DeviceArray<cuda::bf16> taps = t.device_taps();
    DrafterGpuSequence gs{taps.data(), t.seq.ids, t.seq.loss_mask, t.seq.anchors, t.seq.num_blocks, t.seq.gamma};
    DrafterGpuStepOptions opt;
    opt.ce_chunk_bytes = 7 * 300 * 4;  // row chunks of 16 rows: 24 rows = one full chunk and one partial
    const DrafterGpuStepResult r = gpu.step(gs, opt);
    const double eloss = std::abs(r.loss - double(ref.loss)) / std::abs(double(ref.loss));
    std::printf("[gpu drafter] loss gpu %.6f cpu %.6f rel %.2e\n", r.loss, double(ref.loss), eloss);
    EXPECT_LE(eloss, 1e-2);
    EXPECT_NEAR(r.weight_sum, double(ref.weight_sum), 1e-5);
    EXPECT_EQ(r.slot_count, ref.slot_count);
    int64_t diff = 0;
    for (size_t k = 0; k < r.slot_correct.size(); ++k) diff += std::abs(r.slot_correct[k] - ref.slot_correct[k]);
    EXPECT_LE(diff, 2) << "top-1 hits may flip only on near ties";
    const auto g = gpu.grads();
    const auto gn = g.named(), rn = ref.grads.named();
    double worst = 0;
    for (size_t i = 0; i < gn.size(); ++i) {
      const double e = test::rel_l2(gn[i].second->data, rn[i].second->data);
      worst = std::max(worst, e);
      EXPECT_LE(e, test::kTolBf16DrafterStep) << gn[i].first;
    }
    std::printf("[gpu drafter] worst gradient rel L2 vs CPU fp32: %.2e\n", worst);

    // Activation recomputation runs the same kernels on the same inputs: bitwise the same gradients.
    {
      DrafterGpu again(t.cfg, t.w, t.embed, t.lm_head, s);
      DrafterGpuStepOptions ro = opt;
      ro.recompute = true;
      const DrafterGpuStepResult rr = again.step(gs, ro);
      EXPECT_EQ(rr.loss, r.loss);
      const auto rg = again.grads();
      const auto rgn = rg.named();
      for (size_t i = 0; i < gn.size(); ++i) EXPECT_EQ(rgn[i].second->data, gn[i].second->data) << rgn[i].first;
    }

    // zero_grads() only marks the buffer: reads see zeros (grads(), grad_data()), a step without a
    // backward keeps it so, and the next backward overwrites every gradient (beta 0 GEMMs, norm
    // gradients zeroed): one step's gradients again, whatever the buffer held.
    {
      DrafterGpu lazy(t.cfg, t.w, t.embed, t.lm_head, s);
      auto expect_one_step = [&](const char* what) {
        const auto lg = lazy.grads();
        const auto lgn = lg.named();
        for (size_t i = 0; i < gn.size(); ++i)
          EXPECT_LE(test::rel_l2(lgn[i].second->data, gn[i].second->data), 1e-6) << what << ": " << lgn[i].first;
      };
      auto expect_zero = [&](const DrafterWeights<float>& w, const char* what) {
        for (const auto& [name, x] : w.named())
          for (float v : x->data) ASSERT_EQ(v, 0.f) << what << ": " << name;
      };
      lazy.step(gs, opt);
      lazy.step(gs, opt);  // the buffer holds two steps' sum
      lazy.zero_grads();
      expect_zero(lazy.grads(), "grads() after zero_grads()");
      lazy.step(gs, opt);
      expect_one_step("the backward after zero_grads()");
      lazy.zero_grads();
      DrafterGpuStepOptions no_bwd = opt;
      no_bwd.backward = false;
      lazy.step(gs, no_bwd);
      std::vector<float> flat(static_cast<size_t>(lazy.num_params()));
      const float* dg = lazy.grad_data();
      DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
      DFLASH_CUDA_CHECK(cudaMemcpy(flat.data(), dg, flat.size() * sizeof(float), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < flat.size(); ++i) ASSERT_EQ(flat[i], 0.f) << "grad_data() after zero_grads(), element " << i;
      lazy.step(gs, opt);  // adds to the zeros grad_data() wrote
      expect_one_step("a backward after grad_data()");
    }

    // Accumulation: a second identical micro-batch doubles the gradient; scaling by 1/2 restores it.
    gpu.step(gs, opt);
    gpu.scale_grads(0.5f);
    const auto g2 = gpu.grads();
    const auto g2n = g2.named();
    for (size_t i = 0; i < gn.size(); ++i)
      EXPECT_LE(test::rel_l2(g2n[i].second->data, gn[i].second->data), 1e-6) << g2n[i].first;

    // One fused clip + AdamW step vs the CPU optimizer on the GPU's own gradients.
    AdamWOptions ao;
    const ClipResult clip = gpu.optimizer_step(ao, 1e-3, 1.0, 1);
    DrafterWeights<float> cw = t.w, cg = g;
    std::vector<NamedSpan<float>> ps, gs2;
    for (auto& [n, x] : cw.named()) ps.push_back({n, x->data});
    for (auto& [n, x] : cg.named()) gs2.push_back({n, x->data});
    const ClipResult cclip = clip_grad_norm(gs2, 1.0);
    EXPECT_NEAR(clip.norm, cclip.norm, 1e-6 * cclip.norm);
    AdamW<float> adam(ps, ao);
    std::vector<NamedSpan<const float>> cgs;
    for (auto& x : gs2) cgs.push_back({x.name, x.data});
    adam.step(ps, cgs, 1e-3);
    const auto after = gpu.weights();
    const auto an = after.named();
    const auto cn = cw.named();
    for (size_t i = 0; i < an.size(); ++i)
      EXPECT_LE(test::rel_l2(an[i].second->data, cn[i].second->data), 1e-6) << an[i].first;
  }
  DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
}

// NaN / Inf in the taps is flagged by the step itself (the trainer then skips the step naming the
// example), for a NaN and an Inf anywhere in the taps, and never for finite taps.
TEST_F(CudaDrafter, FlagsNonFiniteTaps) {
  Tiny t;
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    DrafterGpu gpu(t.cfg, t.w, t.embed, t.lm_head, s);
    std::vector<uint16_t> tb(t.taps.data.size());
    for (size_t i = 0; i < tb.size(); ++i) tb[i] = f32_to_bf16(t.taps.data[i]);
    for (const auto& [at, bits] : std::vector<std::pair<size_t, uint16_t>>{{0, 0}, {tb.size() - 1, 0x7FC0}, {777, 0xFF80}}) {
      std::vector<uint16_t> bad = tb;
      if (bits) bad[at] = bits;  // quiet NaN / -Inf
      cuda::DeviceArray<cuda::bf16> taps(bad.size());
      DFLASH_CUDA_CHECK(cudaMemcpy(taps.data(), bad.data(), bad.size() * 2, cudaMemcpyHostToDevice));
      DrafterGpuSequence gs{taps.data(), t.seq.ids, t.seq.loss_mask, t.seq.anchors, t.seq.num_blocks, t.seq.gamma};
      DrafterGpuStepOptions opt;
      opt.backward = false;
      EXPECT_EQ(gpu.step(gs, opt).nonfinite_taps, bits != 0) << "element " << at;
    }
  }
  cudaStreamDestroy(s);
}

#endif
