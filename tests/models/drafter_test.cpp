// DFlash drafter forward + hand-written backward vs the PyTorch golden (tests/fixtures/drafter,
// scripts/dflash_reference.py), in float64 and float32, plus a float64 finite-difference check.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "io/safetensors.h"
#include "models/drafter.h"
#include "ops/dflash_attention.h"
#include "test_util.h"

using namespace dflash;

namespace {

using test::read_f64;
using test::read_i64;
using test::read_tensor;
using test::rel_l2;

const double kGamma = 2.0;  // golden_meta.json "gamma"

std::string dir() { return (test::fixtures_dir() / "drafter").string(); }

template <typename T>
struct Problem {
  DrafterConfig cfg;
  DrafterWeights<T> w;
  BasicTensor<T> taps, embed, lm_head;
  DrafterSequence<T> seq;

  Problem() {
    w = load_drafter_weights<T>((std::filesystem::path(dir()) / "init").string(), &cfg);
    const SafetensorsFile in((std::filesystem::path(dir()) / "inputs.safetensors").string());
    taps = read_tensor<T>(in, "taps");
    embed = read_tensor<T>(in, "embed_tokens");
    lm_head = read_tensor<T>(in, "lm_head");
    seq.taps = &taps;
    seq.embed = &embed;
    seq.lm_head = &lm_head;
    seq.ids = read_i64(in, "ids");
    seq.loss_mask = read_i64(in, "loss_mask");
    const std::vector<int64_t> anchors = read_i64(in, "anchors");
    seq.num_blocks = int64_t(anchors.size());
    for (int64_t a : anchors)
      if (a >= 0) seq.anchors.push_back(a);  // -1 = padding block (the trailing ones)
    seq.gamma = kGamma;
    EXPECT_EQ(read_i64(in, "mask_token_id").at(0), cfg.mask_token_id);
  }
};

struct Golden {
  SafetensorsFile f{(std::filesystem::path(dir()) / "golden.safetensors").string()};
};

template <typename T>
void check_against_golden(double tol_loss, double tol_logits, double tol_grad, double* worst_grad_out) {
  Problem<T> p;
  DrafterStepOptions opt;
  opt.keep_logits = true;
  opt.ce_row_chunk = 7;  // exercise the chunking
  opt.ce_vocab_chunk = 40;
  const DrafterStepResult<T> r = drafter_step(p.cfg, p.w, p.seq, opt);
  Golden g;
  const double loss = read_f64(g.f, "loss").at(0);
  const double loss_rel = std::abs(double(r.loss) - loss) / std::abs(loss);
  EXPECT_LE(loss_rel, tol_loss) << "loss " << r.loss << " vs " << loss;
  std::printf("[drafter %s] loss %.15f rel err %.3e\n", sizeof(T) == 8 ? "f64" : "f32", double(r.loss), loss_rel);
  const int64_t B = p.cfg.block_size, V = p.cfg.vocab_size;
  // logits: whole [N, B, V] (padding block included), and the two selected blocks
  const std::vector<double> all = read_f64(g.f, "logits.all");
  EXPECT_LE(rel_l2(r.logits.data, all), tol_logits);
  for (int b : {0, 2}) {
    const std::vector<double> gb = read_f64(g.f, "logits.block" + std::to_string(b));
    std::vector<T> mine(r.logits.data.begin() + b * B * V, r.logits.data.begin() + (b + 1) * B * V);
    const double e = rel_l2(mine, gb);
    EXPECT_LE(e, tol_logits) << "block " << b;
    std::printf("[drafter %s] logits block %d rel L2 %.3e\n", sizeof(T) == 8 ? "f64" : "f32", b, e);
  }
  const std::vector<double> correct = read_f64(g.f, "slot_correct"), count = read_f64(g.f, "slot_count");
  for (int64_t k = 0; k < B; ++k) {
    EXPECT_EQ(r.slot_correct[size_t(k)], int64_t(correct[size_t(k)])) << "slot " << k;
    EXPECT_EQ(r.slot_count[size_t(k)], int64_t(count[size_t(k)])) << "slot " << k;
  }
  double worst = 0, worst_rounded = 0;
  for (const auto& [name, t] : r.grads.named()) {
    const std::vector<double> gg = read_f64(g.f, "grad." + name);
    ASSERT_EQ(gg.size(), t->data.size()) << name;
    const double e = rel_l2(t->data, gg);
    worst = std::max(worst, e);
    EXPECT_LE(e, tol_grad) << name;
    if constexpr (sizeof(T) == 8) {
      // The golden stores fp32: every golden element must be our float64 value rounded to fp32
      // (within 1e-10 relative of a rounding boundary); equivalently rel L2 after rounding <= 1e-8.
      std::vector<float> rounded(t->data.begin(), t->data.end());
      int64_t bad = 0;
      for (size_t i = 0; i < gg.size(); ++i) {
        const double ulp = std::abs(double(std::nextafter(float(gg[i]), INFINITY)) - gg[i]);
        if (std::abs(t->data[i] - gg[i]) > 0.5 * ulp + 1e-10 * std::abs(gg[i]) + 1e-300) ++bad;
      }
      EXPECT_EQ(bad, 0) << name;
      const double er = rel_l2(rounded, gg);
      worst_rounded = std::max(worst_rounded, er);
      EXPECT_LE(er, 1e-8) << name;
    }
  }
  if (sizeof(T) == 8) std::printf("[drafter f64] worst grad rel L2 after fp32 rounding: %.3e\n", worst_rounded);
  if (worst_grad_out) *worst_grad_out = worst;
}

}  // namespace

TEST(Drafter, LoaderIsStrict) {
  DrafterConfig cfg;
  const auto w = load_drafter_weights<float>((std::filesystem::path(dir()) / "init").string(), &cfg);
  EXPECT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.fc.shape, (std::vector<int64_t>{48, 144}));
  test::TempDir td;
  std::filesystem::copy_file(std::filesystem::path(dir()) / "init" / "config.json", td / "config.json");
  // drop one tensor -> error naming it
  const SafetensorsFile src((std::filesystem::path(dir()) / "init" / "model.safetensors").string());
  std::vector<SafetensorsEntry> entries;
  for (const TensorInfo& info : src.tensors())
    if (info.name != "layers.1.mlp.up_proj.weight")
      entries.push_back({info.name, info.dtype, info.shape, src.data(info.name)});
  write_safetensors((td / "model.safetensors").string(), entries);
  try {
    load_drafter_weights<double>(td.path().string(), nullptr);
    FAIL() << "missing tensor accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.1.mlp.up_proj.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Drafter, MatchesGoldenFloat64) {
  // Golden gradients are stored as float32 (rounding ~6e-8 relative per element, ~3e-8 rel L2), so a
  // float64 comparison of gradients cannot go below that; loss and logits are stored as float64.
  double worst = 0;
  check_against_golden<double>(1e-10, 1e-9, 1e-7, &worst);
  std::printf("[drafter f64] worst grad rel L2 vs fp32-stored golden: %.3e\n", worst);
}

TEST(Drafter, MatchesGoldenFloat32) {
  double worst = 0;
  check_against_golden<float>(1e-5, 1e-5, 1e-5, &worst);
  std::printf("[drafter f32] worst grad rel L2: %.3e\n", worst);
}

TEST(Drafter, FiniteDifferencesFloat64) {
  Problem<double> p;
  const DrafterStepResult<double> r = drafter_step(p.cfg, p.w, p.seq);
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd;
  DrafterStepOptions fwd;
  fwd.backward = false;
  for (int dirn = 0; dirn < 3; ++dirn) {
    DrafterWeights<double> delta = drafter_zeros<double>(p.cfg);
    double nrm = 0;
    for (auto& [name, t] : delta.named())
      for (double& v : t->data) {
        v = nd(rng);
        nrm += v * v;
      }
    nrm = std::sqrt(nrm);
    double an = 0;
    auto dn = delta.named();
    const auto gn = r.grads.named();
    for (size_t i = 0; i < dn.size(); ++i)
      for (size_t j = 0; j < dn[i].second->data.size(); ++j) {
        dn[i].second->data[j] /= nrm;
        an += dn[i].second->data[j] * gn[i].second->data[j];
      }
    auto loss_at = [&](double h) {
      DrafterWeights<double> w2 = p.w;
      auto wn = w2.named();
      for (size_t i = 0; i < wn.size(); ++i)
        for (size_t j = 0; j < wn[i].second->data.size(); ++j) wn[i].second->data[j] += h * dn[i].second->data[j];
      return drafter_step(p.cfg, w2, p.seq, fwd).loss;
    };
    const double fd = test::central_difference(loss_at, 1e-3);
    const double rel = std::abs(fd - an) / std::max(std::abs(an), 1e-12);
    std::printf("[drafter fd] direction %d: analytic %+.12e fd %+.12e rel %.2e\n", dirn, an, fd, rel);
    EXPECT_LE(rel, 1e-6);
  }
}

// The mask the step uses (dflash_kv_ranges, per layer type) against the reference's boolean masks
// element by element: a sliding layer (window 6) and a full layer, a late anchor whose block runs
// past the sequence, and a padding block (rows all False).
TEST(Drafter, MaskMatchesGoldenElementByElement) {
  Problem<double> p;
  Golden g;
  const int64_t S = int64_t(p.seq.ids.size()), B = p.cfg.block_size, N = p.seq.num_blocks;
  ASSERT_LT(int64_t(p.seq.anchors.size()), N) << "the fixture must contain a padding block";
  for (int64_t layer = 0; layer < p.cfg.num_hidden_layers; ++layer) {
    const std::string name = "mask.layer" + std::to_string(layer);
    const TensorInfo* info = g.f.find(name);
    ASSERT_NE(info, nullptr) << name;
    ASSERT_EQ(info->dtype, DType::BOOL) << name;
    ASSERT_EQ(info->shape, (std::vector<int64_t>{N * B, S + N * B})) << name;
    const auto* bits = static_cast<const uint8_t*>(g.f.data(name));
    const bool sliding = p.cfg.layer_types[size_t(layer)] == "sliding_attention";
    EXPECT_EQ(sliding, layer == 0);
    const auto ranges = cpu::dflash_kv_ranges(p.seq.anchors, N, B, S, p.cfg.layer_window(layer), p.cfg.layer_causal(layer));
    int64_t mismatches = 0, allowed = 0;
    for (int64_t r = 0; r < N * B; ++r)
      for (int64_t c = 0; c < S + N * B; ++c) {
        const auto& kr = ranges[size_t(r)];
        const bool mine = (c >= kr.ctx_begin && c < kr.ctx_end) || (c >= kr.blk_begin && c < kr.blk_end);
        const bool want = bits[r * (S + N * B) + c] != 0;
        allowed += want;
        if (mine != want && ++mismatches <= 5)
          ADD_FAILURE() << name << " row " << r << " col " << c << ": mine " << mine << " golden " << want;
      }
    EXPECT_EQ(mismatches, 0) << name;
    EXPECT_GT(allowed, 0) << name;
  }
}

// Checkpoints as SpecForge / HF save_pretrained may write them: sharded with an index, names with a
// "model." prefix. They load to the same weights as the single-file original.
TEST(Drafter, LoadsShardedPrefixedCheckpoints) {
  DrafterConfig cfg;
  const auto ref = load_drafter_weights<float>((std::filesystem::path(dir()) / "init").string(), &cfg);
  test::TempDir td;
  std::filesystem::copy_file(std::filesystem::path(dir()) / "init" / "config.json", td / "config.json");
  const SafetensorsFile src((std::filesystem::path(dir()) / "init" / "model.safetensors").string());
  std::vector<SafetensorsEntry> shard[2];
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (const TensorInfo& info : src.tensors()) {
    const int s = (i++) % 2;
    const std::string name = "model." + info.name;
    shard[s].push_back({name, info.dtype, info.shape, src.data(info.name)});
    index["weight_map"][name] = "model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
  }
  for (int s = 0; s < 2; ++s)
    write_safetensors((td / ("model-0000" + std::to_string(s + 1) + "-of-00002.safetensors")).string(), shard[s]);
  test::write_file(td / "model.safetensors.index.json", index.dump());
  const auto w = load_drafter_weights<float>(td.path().string(), nullptr);
  const auto a = w.named(), b = ref.named();
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(a[k].second->data, b[k].second->data) << a[k].first;
}

// Drafting from a context cache (keys / values of context rows computed once, as tokens are
// committed, in pieces) gives the logits of the training forward for one block anchored at the
// context's length: full and sliding-window layers, an empty context, contexts grown piece by piece.
TEST(Drafter, DraftFromTheContextCacheEqualsTheTrainingForward) {
  Problem<float> p;  // 23 positions of taps, a sliding layer (tests/fixtures/drafter)
  DrafterContextCache cache;
  int64_t done = 0;
  for (int64_t len : {0, 1, 2, 7, 15, 22}) {
    if (len > done) drafter_extend_context(p.cfg, p.w, cache, slice_rows(p.taps, done, len));
    done = len;
    ASSERT_EQ(cache.length, len);
    const int32_t last = int32_t(p.seq.ids[size_t(len)]);
    const Tensor got = drafter_draft_logits(p.cfg, p.w, cache, last, p.embed, p.lm_head);
    Tensor taps({len + 1, p.taps.dim(1)});  // row `len` (the anchor's own features) is hidden by the mask
    std::copy_n(p.taps.ptr(), len * p.taps.dim(1), taps.ptr());
    DrafterSequence<float> seq;
    seq.taps = &taps, seq.embed = &p.embed, seq.lm_head = &p.lm_head;
    seq.ids.assign(size_t(len + 1), 0);
    seq.ids[size_t(len)] = last;
    seq.loss_mask.assign(size_t(len + 1), 0);
    seq.anchors = {len};
    seq.num_blocks = 1;
    DrafterStepOptions o;
    o.backward = false;
    o.keep_logits = true;
    const auto want = drafter_step(p.cfg, p.w, seq, o);
    ASSERT_EQ(got.shape, want.logits.shape);
    EXPECT_LE(test::rel_l2(got.data, want.logits.data), test::kTolF32) << "context length " << len;
  }
  EXPECT_THROW(drafter_extend_context(p.cfg, p.w, cache, Tensor({2, 5})), std::invalid_argument);
  EXPECT_THROW(drafter_draft_logits(p.cfg, p.w, cache, int32_t(p.embed.dim(0)), p.embed, p.lm_head),
               std::invalid_argument);
}

TEST(Drafter, DpaceWeightsByHand) {
  // One block of 4: slot 0 has no label; CE ln 2, ln 4, 0 -> q 1/2, 1/4, 1 -> q~ 3/4, 5/8, 1;
  // P 3/4, 15/32, 15/32; w_k = sum_{m >= k} P_m: 27/16, 15/16, 15/32.
  const double l2 = std::log(2.0), l4 = std::log(4.0);
  auto w = dpace_weights({9.0, l2, l4, 0.0}, {false, true, true, true}, 4);
  const std::vector<double> want{0.0, 27.0 / 16, 15.0 / 16, 15.0 / 32};
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(w[i], want[i], 1e-15) << i;
  // A row without a label (a prompt token) weighs 0 and does not lower the later slots' chance; a
  // second block is its own.
  w = dpace_weights({0, l2, 5.0, l4, 0, 0, 0, 0}, {false, true, false, true, false, true, true, true}, 4);
  EXPECT_NEAR(w[1], 0.75 + 0.75 + 0.75 * 0.625, 1e-15);
  EXPECT_EQ(w[2], 0.0);
  EXPECT_NEAR(w[3], 0.75 * 0.625, 1e-15);
  EXPECT_NEAR(w[5], 3.0, 1e-15);  // CE 0 everywhere: P = 1, w_k = B - k
  EXPECT_NEAR(w[7], 1.0, 1e-15);
  EXPECT_THROW(dpace_weights({0, 0, 0}, {true, true, true}, 2), std::invalid_argument);
}

TEST(Drafter, DpaceStepWeighsEachRowByItsOwnCe) {
  // The D-PACE step's loss against the same weights computed by hand from the plain step's logits.
  Problem<double> p;
  DrafterStepOptions o;
  o.keep_logits = true;
  const DrafterStepResult<double> plain = drafter_step(p.cfg, p.w, p.seq, o);
  p.seq.dpace = true;
  const DrafterStepResult<double> dp = drafter_step(p.cfg, p.w, p.seq, o);
  const int64_t B = p.cfg.block_size, N = p.seq.num_blocks, V = plain.logits.dim(1);
  const BlockLayout lay = block_layout(p.seq.ids, p.seq.loss_mask, p.seq.anchors, N, B, p.cfg.mask_token_id, kGamma);
  std::vector<double> ce(size_t(N * B), 0.0);
  std::vector<bool> valid(size_t(N * B), false);
  for (int64_t r = 0; r < N * B; ++r) {
    if (lay.weights[size_t(r)] <= 0) continue;
    const double* z = plain.logits.ptr() + r * V;
    double m = z[0], sum = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, z[v]);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
    ce[size_t(r)] = m + std::log(sum) - z[lay.labels[size_t(r)]];
    valid[size_t(r)] = true;
  }
  const std::vector<double> w = dpace_weights(ce, valid, B);
  double num = 0, den = 0;
  for (size_t r = 0; r < w.size(); ++r) num += w[r] * ce[r], den += w[r];
  EXPECT_NEAR(dp.loss, num / den, 1e-12);
  EXPECT_NEAR(dp.weight_sum, den, 1e-12);
  EXPECT_GT(std::abs(dp.loss - plain.loss), 1e-6);  // not the gamma decay's
  EXPECT_EQ(dp.slot_count, plain.slot_count);
}
