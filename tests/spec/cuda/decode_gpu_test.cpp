// Decoding on the GPU: the KV-cached forward against the full forward (fed piece by piece, packed
// batches, after rollbacks), speculative decoding on the GPU engine equal to its plain greedy
// decoding, and the GPU drafter's batched drafts from its context cache against the CPU reference.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <random>

#include "models/cuda/target_gpu.h"
#include "models/dspark.h"
#include "spec/oracle_drafter.h"
#include "spec/speculative.h"
#include "cuda_test_util.h"
#include "test_util.h"
#include "train/trainer.h"

using namespace dflash;

using CudaDecode = test::GpuTest;

namespace {

std::vector<int32_t> random_ids(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> r(static_cast<size_t>(n));
  for (auto& t : r) t = int32_t(g() % uint32_t(V));
  return r;
}

std::unique_ptr<TargetModel> hd64(const std::string& name = "qwen3_hd64") {
  return TargetModel::load((test::fixtures_dir() / name).string());
}

/// Two taps where the target has room (never its last layer: no server could capture it), else one.
std::vector<int64_t> taps_for(int64_t layers) {
  return layers > 2 ? std::vector<int64_t>{0, layers - 2} : std::vector<int64_t>{0};
}

DrafterConfig drafter_for(const ModelSpec& t) {
  DrafterOverrides ov;
  ov.num_hidden_layers = 2;
  ov.block_size = 4;
  ov.mask_token_id = t.vocab_size - 1;
  ov.target_layer_ids = taps_for(t.num_hidden_layers);
  return derive_drafter_config(t, nullptr, ov);
}
}  // namespace

// A dense target, a Qwen3.5 hybrid (GatedDeltaNet conv windows and states in the cache) and a
// hybrid with mixture-of-experts FFNs.
class CudaDecodeTargets : public test::GpuTestWithParam<std::string> {};

TEST_P(CudaDecodeTargets, CachedForwardEqualsFullForward) {
  const auto m = hd64(GetParam());
  const int64_t V = m->spec().vocab_size;
  const bool hybrid = m->spec().linear_num_value_heads > 0;
  cudaStream_t s;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  {
    TargetGpu gpu(*m, s);
    // Three sequences fed in different pieces (one gets nothing in a step), rollbacks into the step
    // before (run with keep_rollback: GatedDeltaNet layers go token by token and keep the state before
    // it and every token's inputs; a rollback replays the accepted tokens). Each piece against the
    // uncached GPU forward of the whole prefix.
    std::vector<std::vector<int32_t>> seqs{random_ids(40, V, 1), random_ids(300, V, 2), random_ids(7, V, 3)};
    gpu.reset_cache(3);
    ForwardOptions o;
    o.hidden_states = {1};
    std::vector<size_t> at(3, 0);
    const std::vector<std::vector<size_t>> pieces{{10, 200, 3}, {0, 1, 1}, {16, 16, 0}, {14, 83, 3}};
    for (size_t p = 0; p < pieces.size(); ++p) {
      const auto& step = pieces[p];
      std::vector<int32_t> ids;
      std::vector<int64_t> cu{0};
      for (size_t q = 0; q < 3; ++q) {
        ids.insert(ids.end(), seqs[q].begin() + long(at[q]), seqs[q].begin() + long(at[q] + step[q]));
        cu.push_back(int64_t(ids.size()));
      }
      o.keep_rollback = p == 2;
      const ForwardOutput got = gpu.forward_cached(ids, cu, o);
      ForwardOptions full;
      full.hidden_states = {1};
      for (size_t q = 0; q < 3; ++q) {
        if (!step[q]) continue;
        const std::vector<int32_t> prefix(seqs[q].begin(), seqs[q].begin() + long(at[q] + step[q]));
        const ForwardOutput want = gpu.forward(prefix, {0, int64_t(prefix.size())}, full);
        const double e = test::rel_l2(slice_rows(got.logits, cu[q], cu[q + 1]).data,
                                      slice_rows(want.logits, int64_t(at[q]), int64_t(at[q] + step[q])).data);
        std::printf("[gpu decode] %s step %zu sequence %zu: cached vs full logits rel L2 %.2e\n", GetParam().c_str(), p,
                    q, e);
        EXPECT_LE(e, test::kTolBf16Target) << "sequence " << q << " tokens [" << at[q] << ", " << at[q] + step[q] << ")";
        EXPECT_LE(test::rel_l2(slice_rows(got.hidden_states.at(1), cu[q], cu[q + 1]).data,
                               slice_rows(want.hidden_states.at(1), int64_t(at[q]), int64_t(at[q] + step[q])).data),
                  test::kTolBf16Target);
        at[q] += step[q];
      }
      if (p == 2) {
        // Roll sequence 0 back to before the whole step (the state saved before it; in two
        // truncations) and sequence 1 to 4 tokens into it (rows 16.. of that step: a replay of its
        // accepted tokens), then feed other tokens there: the next step checks them.
        gpu.truncate_cache(0, 22);
        gpu.truncate_cache(0, 10);
        gpu.truncate_cache(1, 205);
        for (size_t i = 10; i < 26; ++i) seqs[0][i] = int32_t((seqs[0][i] + 7) % V);
        for (size_t i = 205; i < 217; ++i) seqs[1][i] = int32_t((seqs[1][i] + 3) % V);
        at[0] = 10, at[1] = 205;
        if (hybrid) {  // sequence 2 had no tokens in that step: nothing of it can be dropped
          EXPECT_THROW(gpu.truncate_cache(2, int64_t(at[2]) - 1), std::invalid_argument);
        }
      }
    }
    EXPECT_EQ(gpu.cached_length(1), 288);
    EXPECT_THROW(gpu.truncate_cache(0, 1000), std::invalid_argument);
    EXPECT_THROW(gpu.forward_cached({1}, {0, 1}, o), std::invalid_argument);  // 1 sequence given, 3 cached
    if (hybrid) {  // the last step kept no per-token states: its tokens cannot be dropped, only all of them
      EXPECT_THROW(gpu.truncate_cache(1, 287), std::invalid_argument);
    }
    gpu.truncate_cache(1, 0);  // emptied: starts again from zero states
    const ForwardOutput again = gpu.forward_cached({seqs[1][0], seqs[1][1]}, {0, 0, 2, 2}, o);
    const ForwardOutput want = gpu.forward({seqs[1][0], seqs[1][1]}, {0, 2}, ForwardOptions{});
    EXPECT_LE(test::rel_l2(again.logits.data, want.logits.data), test::kTolBf16Target);
  }
  cudaStreamDestroy(s);
}

TEST_P(CudaDecodeTargets, SpeculativeEqualsPlainGreedyOnTheGpuEngine) {
  const auto m = hd64(GetParam());
  const DrafterConfig cfg = drafter_for(m->spec());
  auto dec = make_gpu_decoder(*m, cfg.target_layer_ids, 0);
  const std::vector<std::vector<int32_t>> ps{random_ids(9, 200, 4), random_ids(33, 200, 5)};
  GenerateOptions o;
  o.max_new_tokens = 48;
  const auto plain = generate(*dec, nullptr, ps, o);
  GenerateOptions longer = o;
  longer.max_new_tokens = 48 + 5;
  auto streams = ps;
  const auto more = generate(*dec, nullptr, ps, longer);
  for (size_t q = 0; q < ps.size(); ++q)
    streams[q].insert(streams[q].end(), more.seqs[q].tokens.begin(), more.seqs[q].tokens.end());
  test::OracleDrafter oracle(cfg, streams, /*corrupt=*/true);
  const auto spec = generate(*dec, &oracle, ps, o);
  auto random = make_gpu_drafter(cfg, init_drafter_weights(cfg, 5), m->embed_tokens(), m->lm_head(), 0);
  const auto spec_random = generate(*dec, random.get(), ps, o);
  for (size_t q = 0; q < ps.size(); ++q) {
    EXPECT_EQ(spec.seqs[q].tokens, plain.seqs[q].tokens) << "prompt " << q << " (oracle drafter)";
    EXPECT_EQ(spec_random.seqs[q].tokens, plain.seqs[q].tokens) << "prompt " << q << " (random drafter)";
  }
  // Continuous batching: two slots, three prompts, prompt 0 stopping early, so prompt 2's prefill
  // runs between prompt 1's verification and its rollback.
  const std::vector<std::vector<int32_t>> ps3{ps[0], ps[1], random_ids(5, 200, 6)};
  GenerateOptions cb = o;
  cb.max_batch = 2;
  cb.stop_token_ids = {plain.seqs[0].tokens[4]};
  const auto plain3 = generate(*dec, nullptr, ps3, cb);
  const auto spec3 = generate(*dec, random.get(), ps3, cb);
  EXPECT_TRUE(plain3.seqs[0].stopped);
  for (size_t q = 0; q < ps3.size(); ++q) EXPECT_EQ(spec3.seqs[q].tokens, plain3.seqs[q].tokens) << "prompt " << q;
  const AcceptanceStats a = acceptance_stats(spec.seqs, cfg.block_size);
  for (int64_t j = 1; j <= cfg.block_size; ++j) EXPECT_GT(a.histogram[size_t(j)], 0) << j;
}

INSTANTIATE_TEST_SUITE_P(Targets, CudaDecodeTargets,
                         ::testing::Values("qwen3_hd64", "qwen3_5_text_hd64", "qwen3_5_moe_hd64"));

// The GPU drafter's drafts (context cache, every sequence's block in one forward) against the CPU
// reference drafter (drafter_draft_logits, itself tested equal to the training forward): each
// slot's token equals the reference's argmax wherever the reference's top-two logits are apart by
// more than the bf16 error could bridge. Contexts arrive in pieces, one sequence is idle, layer 0
// is a sliding-window layer (window 6, shorter than most contexts), and a context is cleared and
// regrown; with the default RoPE and full layers, and with yarn RoPE and causal layers.
TEST_F(CudaDecode, GpuDrafterDraftsAsTheReference) {
  const auto m = hd64();
  DrafterOverrides ov;
  ov.num_hidden_layers = 2;
  ov.block_size = 4;
  ov.mask_token_id = m->spec().vocab_size - 1;
  ov.target_layer_ids = taps_for(m->spec().num_hidden_layers);
  ov.sliding_window = 6;
  ov.sliding_layers = {0};
  for (bool scaled : {false, true}) {
    SCOPED_TRACE(scaled ? "yarn, causal" : "default RoPE");
    DrafterConfig cfg = derive_drafter_config(m->spec(), nullptr, ov);
    if (scaled) {  // yarn RoPE and every layer causal in its block (published configs' keys)
      cfg.rope.type = "yarn", cfg.rope.factor = 4.0;
      cfg.rope.original_max_position_embeddings = cfg.max_position_embeddings / 4;
      cfg.causal = true;
    }
    const DrafterWeights<float> w = init_drafter_weights(cfg, 9, 0.2);  // larger weights: well separated logits
    auto gpu = make_gpu_drafter(cfg, w, m->embed_tokens(), m->lm_head(), 0);
    const int64_t width = int64_t(cfg.target_layer_ids.size()) * cfg.hidden_size, B = cfg.block_size;
    std::mt19937_64 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto random_taps = [&](int64_t rows) {
      Tensor t({rows, width});
      for (float& x : t.data) x = bf16_to_f32(f32_to_bf16(nd(rng)));
      return t;
    };
    const int n = 4;
    std::vector<DrafterContextCache> ref(n);
    gpu->reset(n);
    int compared = 0;
    auto append = [&](int q, int64_t rows) {
      const Tensor t = random_taps(rows);
      gpu->append_context(q, t);
      drafter_extend_context(cfg, w, ref[size_t(q)], t);
    };
    auto check = [&](const std::vector<int32_t>& last, const std::string& round) {
      const auto drafts = gpu->draft(last);
      ASSERT_EQ(drafts.size(), last.size());
      for (int q = 0; q < n; ++q) {
        if (last[size_t(q)] < 0) {
          EXPECT_TRUE(drafts[size_t(q)].empty()) << round << ": idle sequence " << q << " got a draft";
          continue;
        }
        ASSERT_EQ(int64_t(drafts[size_t(q)].size()), B - 1);
        const Tensor lg = drafter_draft_logits(cfg, w, ref[size_t(q)], last[size_t(q)], m->embed_tokens(), m->lm_head());
        const int64_t V = lg.dim(1);
        for (int64_t k = 1; k < B; ++k) {
          std::vector<float> row(lg.row(k), lg.row(k) + V), sorted = row;
          std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
          float scale = 0;
          for (float x : row) scale = std::max(scale, std::abs(x));
          if (sorted[0] - sorted[1] < 0.05f * scale) continue;  // a near tie: bf16 may pick either
          ++compared;
          EXPECT_EQ(drafts[size_t(q)][size_t(k - 1)], int32_t(std::max_element(row.begin(), row.end()) - row.begin()))
              << round << ": sequence " << q << " (context " << ref[size_t(q)].length << ") slot " << k;
        }
      }
    };
    append(0, 1), append(1, 10), append(3, 60);  // sequence 2 stays empty: a block at position 0
    check({5, 7, 11, 13}, "first");
    append(1, 7), append(3, 30), append(0, 300);  // past the cache's first capacity (256 rows)
    check({17, -1, 19, 23}, "second");
    gpu->clear(3);
    ref[3] = DrafterContextCache{};
    append(3, 5);
    check({29, 31, -1, 37}, "after clear");
    EXPECT_GE(compared, 12) << "too few well-separated slots to compare";
  }
}

// DSpark's Markov walk on the GPU (every slot drafts; each token feeds the next slot's Markov head)
// against the CPU reference: each drafted token is the argmax of the reference's corrected logits
// given the GPU's own earlier tokens (a near tie may go either way in bf16, and then the walks part).
TEST_F(CudaDecode, GpuDsparkDrafterWalksAsTheReference) {
  const auto m = hd64();
  DrafterOverrides ov;
  ov.num_hidden_layers = 2;
  ov.block_size = 5;
  ov.mask_token_id = m->spec().vocab_size - 1;
  ov.target_layer_ids = taps_for(m->spec().num_hidden_layers);
  ov.markov_rank = 64;
  const DrafterConfig cfg = derive_drafter_config(m->spec(), nullptr, ov);
  DrafterWeights<float> w = init_drafter_weights(cfg, 9, 0.2);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : w.markov_w2.data) x = bf16_to_f32(f32_to_bf16(0.3f * nd(rng)));
  auto gpu = make_gpu_drafter(cfg, w, m->embed_tokens(), m->lm_head(), 0);
  const int64_t width = int64_t(cfg.target_layer_ids.size()) * cfg.hidden_size, B = cfg.block_size;
  const int n = 6;
  std::vector<DrafterContextCache> ref(n);
  gpu->reset(n);
  int compared = 0;
  for (int q = 0; q < n; ++q) {
    Tensor t({int64_t(5 + 13 * q), width});
    for (float& x : t.data) x = bf16_to_f32(f32_to_bf16(nd(rng)));
    gpu->append_context(q, t);
    drafter_extend_context(cfg, w, ref[size_t(q)], t);
  }
  const std::vector<int32_t> last = {5, 7, 11, 13, 17, 19};
  const auto drafts = gpu->draft(last);
  for (int q = 0; q < n; ++q) {
    ASSERT_EQ(int64_t(drafts[size_t(q)].size()), B) << "sequence " << q;
    const Tensor h = drafter_draft_hidden(cfg, w, ref[size_t(q)], last[size_t(q)], m->embed_tokens());
    std::vector<int32_t> prev = {last[size_t(q)]};
    prev.insert(prev.end(), drafts[size_t(q)].begin(), drafts[size_t(q)].end() - 1);
    const Tensor z = dspark_logits(w, h, m->lm_head(), prev);
    const int64_t V = z.dim(1);
    for (int64_t k = 0; k < B; ++k) {
      std::vector<float> row(z.row(k), z.row(k) + V), sorted = row;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      float scale = 0;
      for (float x : row) scale = std::max(scale, std::abs(x));
      if (sorted[0] - sorted[1] < 0.05f * scale) continue;  // a near tie: bf16 may pick either
      ++compared;
      EXPECT_EQ(drafts[size_t(q)][size_t(k)], int32_t(std::max_element(row.begin(), row.end()) - row.begin()))
          << "sequence " << q << " slot " << k;
    }
  }
  EXPECT_GE(compared, 8) << "too few well-separated slots to compare";
}

#endif  // DFLASH_HAVE_CUDA
