// Drafter configuration: default taps, mask token choice, derivation from targets, config.json.
#include <gtest/gtest.h>

#include <filesystem>

#include "io/hf_config.h"
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
  EXPECT_DOUBLE_EQ(c.rope_theta, qwen3.rope.theta);
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
