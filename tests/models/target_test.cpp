// The CPU reference forward against golden outputs saved by transformers (scripts/make_fixtures.py):
// logits and every hidden state, single sequences and a packed batch of them.
#include <gtest/gtest.h>

#include <filesystem>
#include <cmath>
#include <functional>
#include <map>

#include "io/safetensors.h"
#include "models/target.h"
#include "test_util.h"

using namespace dflash;

namespace {

using test::load_target_golden;
using Golden = test::TargetGolden;

class TargetFixture : public ::testing::TestWithParam<std::string> {};

ForwardOptions all_outputs(int L) {
  ForwardOptions o;
  for (int j = 0; j <= L; ++j) o.hidden_states.push_back(j);
  return o;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape, want.shape) << what;
  const double err = test::rel_l2(got.data, want.data);
  EXPECT_LE(err, test::kTolF32) << what << ": relative L2 error " << err;
}

}  // namespace

TEST_P(TargetFixture, SingleSequencesMatchTransformers) {
  const auto dir = test::fixtures_dir() / GetParam();
  const Golden g = load_target_golden(dir);
  ASSERT_EQ(g.ids.size(), 3u);
  auto model = TargetModel::load(dir.string());
  ASSERT_EQ(model->spec().num_hidden_layers, g.num_layers);
  for (size_t s = 0; s < g.ids.size(); ++s) {
    const auto out = model->forward(g.ids[s], {0, int64_t(g.ids[s].size())}, all_outputs(g.num_layers));
    expect_close(out.logits, g.logits[s], GetParam() + " seq" + std::to_string(s) + " logits");
    for (int j = 0; j <= g.num_layers; ++j)
      expect_close(out.hidden_states.at(j), g.hidden[s][size_t(j)],
                   GetParam() + " seq" + std::to_string(s) + " hidden_states." + std::to_string(j));
  }
}

TEST_P(TargetFixture, PackedBatchMatchesTransformersPerSequence) {
  const auto dir = test::fixtures_dir() / GetParam();
  const Golden g = load_target_golden(dir);
  auto model = TargetModel::load(dir.string());
  // Longest first, so that a leak from an earlier sequence would show in the short ones.
  std::vector<int32_t> ids;
  std::vector<int64_t> cu{0};
  const std::vector<size_t> order{2, 0, 1};
  for (size_t s : order) {
    ids.insert(ids.end(), g.ids[s].begin(), g.ids[s].end());
    cu.push_back(int64_t(ids.size()));
  }
  const auto out = model->forward(ids, cu, all_outputs(g.num_layers));
  for (size_t i = 0; i < order.size(); ++i) {
    const size_t s = order[i];
    const std::string what = GetParam() + " packed seq" + std::to_string(s);
    expect_close(slice_rows(out.logits, cu[i], cu[i + 1]), g.logits[s], what + " logits");
    for (int j = 0; j <= g.num_layers; ++j)
      expect_close(slice_rows(out.hidden_states.at(j), cu[i], cu[i + 1]), g.hidden[s][size_t(j)],
                   what + " hidden_states." + std::to_string(j));
  }
}

TEST_P(TargetFixture, StopsAtDeepestRequestedLayerWithoutLmHead) {
  const auto dir = test::fixtures_dir() / GetParam();
  const Golden g = load_target_golden(dir);
  auto model = TargetModel::load(dir.string());
  ForwardOptions opt;
  opt.logits = false;
  opt.hidden_states = {1, 2};
  const auto out = model->forward(g.ids[2], {0, int64_t(g.ids[2].size())}, opt);
  EXPECT_EQ(out.logits.numel(), 0);
  ASSERT_EQ(out.hidden_states.size(), 2u);
  expect_close(out.hidden_states.at(2), g.hidden[2][2], GetParam() + " taps only, hidden_states.2");
  // The last hidden state without logits still gets the final norm.
  opt.hidden_states = {g.num_layers};
  const auto last = model->forward(g.ids[2], {0, int64_t(g.ids[2].size())}, opt);
  EXPECT_EQ(last.logits.numel(), 0);
  expect_close(last.hidden_states.at(g.num_layers), g.hidden[2][size_t(g.num_layers)],
               GetParam() + " no logits, hidden_states.L");
  opt.hidden_states = {g.num_layers + 1};
  EXPECT_THROW(model->forward(g.ids[2], {0, int64_t(g.ids[2].size())}, opt), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Target, TargetFixture, ::testing::Values("llama", "qwen3", "qwen3_hd64", "qwen3_5_text", "qwen3_5",
                                                                "qwen3_5_moe", "qwen3_next", "qwen3_5_moe_hd64", "qwen3_next_hd64"));

namespace {
/// Copies the llama fixture into `dir`, with `edit` applied to its tensors before writing.
/// A copy of fixture `name` in dir whose tensors went through `edit` (one model.safetensors).
void write_edited(const std::string& name, const std::filesystem::path& dir,
                  const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  const auto src = test::fixtures_dir() / name;
  std::filesystem::copy_file(src / "config.json", dir / "config.json");
  auto ck = SafetensorsCheckpoint::open(src.string());
  std::map<std::string, Tensor> ts;
  for (const auto& n : ck->names()) ts[n] = ck->load_f32(n);
  edit(ts);
  std::vector<std::pair<std::string, const Tensor*>> refs;
  for (auto& [n, t] : ts) refs.emplace_back(n, &t);
  write_safetensors((dir / "model.safetensors").string(), refs);
}
void write_edited_llama(const std::filesystem::path& dir,
                        const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  write_edited("llama", dir, edit);
}
std::string load_error(const std::filesystem::path& dir) {
  try {
    TargetModel::load(dir.string());
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(TargetLoad, BadWeightsGiveErrorsNamingFileAndTensor) {
  {
    test::TempDir d;
    write_edited_llama(d.path(), [](auto& ts) { ts["model.layers.1.mlp.up_proj.weight"].data[7] = NAN; });
    const std::string e = load_error(d.path());
    EXPECT_NE(e.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("non-finite"), std::string::npos) << e;
  }
  {
    test::TempDir d;
    write_edited_llama(d.path(), [](auto& ts) { ts.erase("model.layers.2.self_attn.k_proj.weight"); });
    const std::string e = load_error(d.path());
    EXPECT_NE(e.find("missing tensor 'model.layers.2.self_attn.k_proj.weight'"), std::string::npos) << e;
  }
  {
    test::TempDir d;  // transposed: same element count, wrong layout
    write_edited_llama(d.path(), [](auto& ts) {
      auto& t = ts["model.layers.0.mlp.down_proj.weight"];
      std::swap(t.shape[0], t.shape[1]);
    });
    const std::string e = load_error(d.path());
    EXPECT_NE(e.find("model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' has shape"), std::string::npos) << e;
  }
}

TEST(TargetLoad, BadForwardInputsAreRejected) {
  auto model = TargetModel::load((test::fixtures_dir() / "llama").string());
  EXPECT_THROW(model->forward({1, 2, 301}, {0, 3}, ForwardOptions{}), std::out_of_range);
  EXPECT_THROW(model->forward({1, 2, 3}, {0, 2}, ForwardOptions{}), std::invalid_argument);
  EXPECT_THROW(model->forward({1, 2, 3}, {1, 3}, ForwardOptions{}), std::invalid_argument);
  // An empty sequence inside a packed batch is allowed and changes nothing for the others.
  const auto a = model->forward({5, 6, 7}, {0, 0, 3}, ForwardOptions{});
  const auto b = model->forward({5, 6, 7}, {0, 3}, ForwardOptions{});
  EXPECT_EQ(a.logits.data, b.logits.data);
}

// The experts of a mixture-of-experts layer stored fused (transformers 5's experts.gate_up_proj
// [E, 2*Im, D] and experts.down_proj [E, D, Im]) give the same model as stored one by one (the
// layout the fixtures, like the Hub checkpoints, use).
TEST(TargetLoad, FusedAndPerExpertLayoutsAreTheSameModel) {
  const auto per_expert = TargetModel::load((test::fixtures_dir() / "qwen3_next").string());
  const ModelSpec& s = per_expert->spec();
  const int64_t E = s.num_experts, Im = s.moe_intermediate_size, D = s.hidden_size;
  test::TempDir d;
  write_edited("qwen3_next", d.path(), [&](std::map<std::string, Tensor>& ts) {
    for (int64_t i = 0; i < s.num_hidden_layers; ++i) {
      if (!s.is_moe_layer(i)) continue;
      const std::string p = "model.layers." + std::to_string(i) + ".mlp.experts.";
      Tensor gu({E, 2 * Im, D}), dn({E, D, Im});
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = p + std::to_string(e) + ".";
        std::copy_n(ts.at(ep + "gate_proj.weight").ptr(), Im * D, gu.ptr() + e * 2 * Im * D);
        std::copy_n(ts.at(ep + "up_proj.weight").ptr(), Im * D, gu.ptr() + e * 2 * Im * D + Im * D);
        std::copy_n(ts.at(ep + "down_proj.weight").ptr(), D * Im, dn.ptr() + e * D * Im);
        for (const char* w : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}) ts.erase(ep + w);
      }
      ts[p + "gate_up_proj"] = std::move(gu);
      ts[p + "down_proj"] = std::move(dn);
    }
  });
  const auto fused = TargetModel::load(d.path().string());
  const std::vector<int32_t> ids{3, 17, 42, 5, 199, 0, 64};
  const ForwardOutput a = per_expert->forward(ids, {0, 7}, ForwardOptions{});
  const ForwardOutput b = fused->forward(ids, {0, 7}, ForwardOptions{});
  EXPECT_EQ(a.logits.data, b.logits.data);
  EXPECT_GT(s.num_experts, 0);
  EXPECT_FALSE(s.is_moe_layer(1));  // mlp_only_layers: layer 1 keeps the dense MLP
  EXPECT_FALSE(s.norm_topk_prob);
  EXPECT_NE(gpu_unsupported_reason(s).find("head_dim 16"), std::string::npos);  // the experts themselves run on the GPU
}
