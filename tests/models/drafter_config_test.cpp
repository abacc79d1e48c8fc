// Drafter configuration: default taps, mask token choice, derivation from targets, config.json.
#include <gtest/gtest.h>

#include <filesystem>

#include "models/hf_config.h"
#include "io/json_file.h"
#include "models/drafter_config.h"
#include "text/tokenizer.h"
#include "test_util.h"

using namespace dflash;

TEST(DrafterConfig, DefaultTapsFollowTheDoc) {
  EXPECT_EQ(default_target_layer_ids(36, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_target_layer_ids(64, 5), (std::vector<int64_t>{1, 16, 31, 46, 61}));
  EXPECT_EQ(default_target_layer_ids(30, 1), (std::vector<int64_t>{15}));
  // Python's round() sends halves to even: 1 + 6.5 = 7.5 -> 8, 1 + 19.5 = 20.5 -> 20.
  EXPECT_EQ(default_target_layer_ids(30, 5), (std::vector<int64_t>{1, 8, 14, 20, 27}));
  EXPECT_THROW(default_target_layer_ids(0, 5), std::invalid_argument);
}

TEST(DrafterConfig, DerivedFromTargetsWithOverrides) {
  const ModelSpec qwen3 = load_hf_config((test::fixtures_dir() / "qwen3" / "config.json").string());
  DrafterOverrides o;
  o.mask_token_id = 250;  // inside both fixtures' vocabularies (301 and 263)
  EXPECT_THROW(derive_drafter_config(qwen3, nullptr, o), std::invalid_argument);  // 3 layers cannot give 5 taps
  o.num_taps = 1;
  DrafterConfig c = derive_drafter_config(qwen3, nullptr, o);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(c.hidden_size, qwen3.hidden_size);
  EXPECT_EQ(c.num_attention_heads, qwen3.num_attention_heads);  // the target's own attention shape
  EXPECT_EQ(c.head_dim, qwen3.head_dim);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_EQ(c.block_size, 16);
  EXPECT_DOUBLE_EQ(c.rope.theta, qwen3.rope.theta);
  const ModelSpec hybrid = load_hf_config((test::fixtures_dir() / "qwen3_5" / "config.json").string());
  c = derive_drafter_config(hybrid, nullptr, o);
  EXPECT_EQ(c.num_attention_heads, 32);  // published Qwen3.5/3.6 drafters
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{2}));
  o.sliding_layers = {0};
  EXPECT_THROW(derive_drafter_config(hybrid, nullptr, o), std::runtime_error);  // no sliding_window
  o.sliding_window = 64;
  EXPECT_EQ(derive_drafter_config(hybrid, nullptr, o).layer_types[0], "sliding_attention");
  o.target_layer_ids = std::vector<int64_t>{4};  // the fixture has 4 layers: 0..3
  EXPECT_THROW(derive_drafter_config(hybrid, nullptr, o), std::runtime_error);
}

TEST(DrafterConfig, MaskTokenFromTheTokenizer) {
  const auto tok_dir = test::source_dir() / ".." / "shared" / "tokenizers" / "qwen3";
  if (!std::filesystem::exists(tok_dir / "tokenizer.json")) GTEST_SKIP() << "no Qwen3 tokenizer at " << tok_dir;
  const auto tok = Tokenizer::load(tok_dir.string());
  ModelSpec qwen3_8b;
  qwen3_8b.vocab_size = 151936;  // embedding rows of Qwen3-8B
  EXPECT_EQ(default_mask_token_id(qwen3_8b, *tok), 151669);  // dflash.md: Qwen3 -> 151669
  qwen3_8b.vocab_size = tok->vocab_size();                    // no spare row: an unused special token
  const int64_t id = default_mask_token_id(qwen3_8b, *tok);
  EXPECT_TRUE(tok->is_special(int32_t(id)));
  EXPECT_EQ(tok->chat_template().find(tok->id_to_token(int32_t(id))), std::string::npos);
}

TEST(DrafterConfig, ConfigJsonRoundTripAndPublishedFormat) {
  const std::string where = (test::fixtures_dir() / "drafter" / "init" / "config.json").string();
  const DrafterConfig c = drafter_config_from_json(read_json_file(where), where);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{1, 3, 5}));
  EXPECT_EQ(c.mask_token_id, 96);
  EXPECT_EQ(c.layer_types[0], "sliding_attention");
  EXPECT_EQ(c.sliding_window, 6);
  const nlohmann::json j = drafter_config_to_json(c);
  EXPECT_EQ(j["architectures"][0], "DFlashDraftModel");
  EXPECT_EQ(j["model_type"], "qwen3");
  const DrafterConfig back = drafter_config_from_json(j, "roundtrip");
  EXPECT_EQ(drafter_config_to_json(back), j);
  nlohmann::json bad = j;
  bad["dflash_config"]["mask_token_id"] = 97;
  EXPECT_THROW(drafter_config_from_json(bad, "bad"), std::runtime_error);
  bad = j;
  bad.erase("dflash_config");
  EXPECT_THROW(drafter_config_from_json(bad, "bad"), std::runtime_error);
}

namespace {
// The config.json layout of a published z-lab drafter (Qwen3-8B-DFlash-b16 shape): DFlash fields plus
// the standard Qwen3 fields and the extras HF writes (auto_map, dtype, use_cache, ...), which are
// ignored.
nlohmann::json published_qwen3_8b_config() {
  return nlohmann::json::parse(R"({
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "attention_bias": false, "attention_dropout": 0.0,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288,
    "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention", "full_attention"],
    "max_position_embeddings": 40960, "max_window_layers": 5, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": false, "transformers_version": "4.57.1", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936
  })");
}
}  // namespace

TEST(DrafterConfig, ReadsThePublishedLayout) {
  const DrafterConfig c = drafter_config_from_json(published_qwen3_8b_config(), "z-lab config.json");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.block_size, 16);
  EXPECT_EQ(c.num_target_layers, 36);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(c.mask_token_id, 151669);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.layer_types, std::vector<std::string>(5, "full_attention"));
  // Written back, every DFlash and shape field keeps its published value.
  const nlohmann::json back = drafter_config_to_json(c), pub = published_qwen3_8b_config();
  for (const char* k : {"architectures", "model_type", "block_size", "dflash_config", "hidden_size", "intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                        "num_target_layers", "vocab_size", "layer_types", "sliding_window", "use_sliding_window",
                        "tie_word_embeddings", "max_position_embeddings"})
    EXPECT_EQ(back[k], pub[k]) << k;
}

TEST(DrafterConfig, OlderConfigsWithoutTapsOrMaskToken) {
  nlohmann::json j = published_qwen3_8b_config();
  j["dflash_config"] = nlohmann::json::object();
  DrafterConfig c = drafter_config_from_json(j, "old config.json");
  // one tap per draft layer with the default formula, as the z-lab / SGLang loaders do
  EXPECT_EQ(c.target_layer_ids, (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(c.mask_token_id, -1);
  j["num_hidden_layers"] = 3;
  j["layer_types"] = std::vector<std::string>(3, "full_attention");
  EXPECT_EQ(drafter_config_from_json(j, "old").target_layer_ids, (std::vector<int64_t>{1, 17, 33}));
  j["dflash_config"]["target_layer_ids"] = "1,2";
  EXPECT_THROW(drafter_config_from_json(j, "bad"), std::runtime_error);

  const auto tok_dir = test::source_dir() / ".." / "shared" / "tokenizers" / "qwen3";
  if (!std::filesystem::exists(tok_dir / "tokenizer.json")) GTEST_SKIP() << "no Qwen3 tokenizer at " << tok_dir;
  // The Qwen3 tokenizer has no <|MASK|>: the id must be given.
  const auto plain = Tokenizer::load(tok_dir.string());
  try {
    resolve_mask_token_id(c, *plain, "old config.json");
    FAIL() << "resolved a mask token that does not exist";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--mask-token-id"), std::string::npos) << e.what();
  }
  // With <|MASK|> added (as the published drafters' tokenizers do), it is taken from there.
  nlohmann::json tj = read_json_file((tok_dir / "tokenizer.json").string());
  tj["added_tokens"].push_back({{"id", 151669}, {"content", "<|MASK|>"}, {"single_word", false}, {"lstrip", false},
                                {"rstrip", false}, {"normalized", false}, {"special", true}});
  test::TempDir td;
  test::write_file(td / "tokenizer.json", tj.dump());
  const auto with_mask = Tokenizer::load(td.path().string());
  resolve_mask_token_id(c, *with_mask, "old config.json");
  EXPECT_EQ(c.mask_token_id, 151669);
}

// Found by fuzz/config_json_fuzz: an integer field holding a number past int64 (parsed as a float)
// was converted with undefined behaviour; now it is refused naming the field.
TEST(DrafterConfigJson, HugeNumberInAnIntegerFieldIsRefused) {
  const auto j = read_json_file(
      (test::source_dir() / "fuzz" / "regressions" / "config_json_fuzz" / "float_max_position_embeddings.json").string());
  try {
    (void)drafter_config_from_json(j, "regression");
    FAIL() << "accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("max_position_embeddings"), std::string::npos) << e.what();
  }
}
