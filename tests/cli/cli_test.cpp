// The dflash command line on the fixtures: inspect (text and JSON), forward (single and packed) and
// clear errors for bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "test_util.h"

using namespace dflash;

namespace {
std::string run_dflash(const std::string& args, int* rc) {
  std::string out;
  *rc = test::run_command(test::dflash_binary().string() + " " + args, &out);
  return out;
}
std::string fixture(const char* name) { return (test::fixtures_dir() / name).string(); }
std::string ids_of(const Tensor& t) {
  std::string s;
  for (float v : t.data) s += (s.empty() ? "" : ",") + std::to_string(int64_t(v));
  return s;
}
}  // namespace

TEST(Cli, InspectJsonListsEveryLayerAndItsKernels) {
  int rc;
  const std::string out = run_dflash("inspect --json " + fixture("qwen3_5"), &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["architecture"], "Qwen3_5ForConditionalGeneration");
  ASSERT_EQ(j["layers"].size(), 4u);
  EXPECT_EQ(j["layers"][0]["type"], "linear_attention (GatedDeltaNet)");
  EXPECT_EQ(j["layers"][2]["type"], "full_attention");
  EXPECT_TRUE(j["layers"][0]["kernels"]["cpu"].is_string());
  EXPECT_GT(j["ignored_tensors"].get<int>(), 0);  // visual + mtp
  EXPECT_EQ(j["dtypes"].begin().key(), "F32");
  EXPECT_GT(j["parameters"].get<int64_t>(), 0);
}

TEST(Cli, InspectTextOnShardedCheckpoint) {
  int rc;
  const std::string out = run_dflash("inspect " + fixture("qwen3"), &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("Qwen3ForCausalLM"), std::string::npos) << out;
  EXPECT_NE(out.find("tied lm_head true"), std::string::npos) << out;
}

TEST(Cli, ForwardPackedMatchesGolden) {
  auto g = SafetensorsCheckpoint::open(fixture("qwen3_5_text") + "/golden.safetensors");
  test::TempDir d;
  int rc;
  const std::string out = run_dflash("forward --model " + fixture("qwen3_5_text") + " --ids " +
                                     ids_of(g->load_f32("seq1.input_ids")) + " --ids " +
                                     ids_of(g->load_f32("seq0.input_ids")) + " --out " + (d / "o.safetensors").string(),
                                 &rc);
  ASSERT_EQ(rc, 0) << out;
  auto o = SafetensorsCheckpoint::open((d / "o.safetensors").string());
  for (const auto& [mine, gold] : std::vector<std::pair<std::string, std::string>>{
           {"seq0.logits", "seq1.logits"}, {"seq1.logits", "seq0.logits"},
           {"seq0.hidden_states.5", "seq1.hidden_states.5"}, {"seq0.hidden_states.0", "seq1.hidden_states.0"}}) {
    ASSERT_TRUE(o->has(mine)) << mine;
    const Tensor a = o->load_f32(mine), b = g->load_f32(gold);
    ASSERT_EQ(a.shape, b.shape) << mine;
    EXPECT_LE(test::rel_l2(a.data, b.data), test::kTolF32) << mine;
  }
}

TEST(Cli, ForwardSingleSequenceHasNoPrefix) {
  test::TempDir d;
  int rc;
  const std::string out = run_dflash("forward --model " + fixture("llama") + " --ids 1,2,3 --out " + (d / "o.safetensors").string(), &rc);
  ASSERT_EQ(rc, 0) << out;
  auto o = SafetensorsCheckpoint::open((d / "o.safetensors").string());
  EXPECT_EQ(o->info("logits").shape, (std::vector<int64_t>{3, 301}));
  EXPECT_EQ(o->info("hidden_states.3").shape, (std::vector<int64_t>{3, 60}));
}

TEST(Cli, BadInputGivesClearErrors) {
  test::TempDir d;
  const std::string o = " --out " + (d / "o.safetensors").string();
  int rc;
  std::string out = run_dflash("forward --model " + fixture("llama") + " --ids 1,x,3" + o, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("'x' is not a token id"), std::string::npos) << out;
  out = run_dflash("forward --model " + fixture("llama") + " --ids 1,2," + o, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("empty token id"), std::string::npos) << out;
  out = run_dflash("forward --model " + fixture("llama") + " --ids 1,99999" + o, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("99999"), std::string::npos) << out;
  out = run_dflash("inspect " + (d / "nope").string(), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("no such file"), std::string::npos) << out;
  out = run_dflash("train --target x", &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("data is required (--data)"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(d / "o.safetensors"));
}
