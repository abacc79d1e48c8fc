// config.json keys as SGLang / vLLM / transformers read them (docs/interop.md): RoPE scaling, the
// dflash_config keys vLLM honours, block_size inside dflash_config, sliding_window only with
// use_sliding_window; what no server would serve is refused; the Qwen3.5 / 3.6 mask token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <tuple>

#include "io/json_file.h"
#include "models/drafter_config.h"
#include "text/tokenizer.h"
#include "test_util.h"

using namespace dflash;

namespace {
/// A small published-layout config: 3 draft layers, taps [1, 4, 7] of a 10-layer target.
nlohmann::json base_config() {
  return nlohmann::json::parse(R"({
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
    "dflash_config": {"mask_token_id": 90, "target_layer_ids": [1, 4, 7]},
    "head_dim": 16, "hidden_size": 64, "intermediate_size": 96, "layer_types": ["full_attention",
    "full_attention", "full_attention"], "max_position_embeddings": 4096, "num_attention_heads": 4,
    "num_hidden_layers": 3, "num_key_value_heads": 2, "num_target_layers": 10, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "sliding_window": null, "use_sliding_window": false, "vocab_size": 100
  })");
}

/// The error drafter_config_from_json gives, or "" when it accepts the config.
std::string error_of(const nlohmann::json& j) {
  try {
    (void)drafter_config_from_json(j, "draft/config.json");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

DrafterConfig read(const nlohmann::json& j) { return drafter_config_from_json(j, "draft/config.json"); }
}  // namespace

TEST(DrafterConfigInterop, RopeScalingIsReadAndWrittenBack) {
  nlohmann::json j = base_config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 1024}};
  DrafterConfig c = read(j);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  // transformers 5's spelling: everything under rope_parameters.
  nlohmann::json k = base_config();
  k.erase("rope_theta");
  k["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e7}, {"factor", 4.0},
                          {"original_max_position_embeddings", 1024}};
  EXPECT_DOUBLE_EQ(read(k).rope.theta, 1e7);
  EXPECT_EQ(read(k).rope.type, "yarn");
  // Written back as rope_scaling, read again the same.
  const nlohmann::json back = drafter_config_to_json(c);
  EXPECT_EQ(back["rope_scaling"]["rope_type"], "yarn");
  EXPECT_EQ(drafter_config_to_json(read(back)), back);
  EXPECT_TRUE(drafter_config_to_json(read(base_config()))["rope_scaling"].is_null());
  // A type no drafter runs is refused, naming the file and the type.
  j["rope_scaling"] = {{"rope_type", "longrope"}};
  EXPECT_NE(error_of(j).find("draft/config.json: rope type 'longrope' is not supported"), std::string::npos)
      << error_of(j);
  j["rope_scaling"] = {{"rope_type", "yarn"}};
  EXPECT_NE(error_of(j).find("'factor'"), std::string::npos) << error_of(j);
  j = base_config();
  j["partial_rotary_factor"] = 0.5;
  EXPECT_NE(error_of(j).find("partial_rotary_factor"), std::string::npos) << error_of(j);
  // What the servers would serve otherwise than transformers: their own knobs, a scale of another
  // form, a factor that transformers versions read differently.
  const nlohmann::json yarn = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 1024}};
  for (const auto& [key, value, says] :
       {std::tuple{"attn_factor", nlohmann::json(1.2), "rope_scaling.attn_factor 1.2"},
        std::tuple{"extrapolation_factor", nlohmann::json(0.5), "rope_scaling.extrapolation_factor 0.5"},
        std::tuple{"attention_factor", nlohmann::json(1.25), "SGLang and vLLM ignore it"},
        std::tuple{"original_max_position_embeddings", nlohmann::json(2048), "transformers versions read the factor"}}) {
    j = base_config();
    j["rope_scaling"] = yarn;
    j["rope_scaling"][key] = value;
    EXPECT_NE(error_of(j).find(says), std::string::npos) << key << ": " << error_of(j);
  }
  j["rope_scaling"] = yarn;  // mscale and mscale_all_dim together change transformers' scale
  j["rope_scaling"]["mscale"] = 1.0, j["rope_scaling"]["mscale_all_dim"] = 0.5;
  EXPECT_NE(error_of(j).find("SGLang and vLLM ignore it"), std::string::npos) << error_of(j);
  j["rope_scaling"] = yarn;
  j["rope_scaling"]["attn_factor"] = 1.0;  // the servers' default: served alike
  j["rope_scaling"]["attention_factor"] = 0.1 * std::log(4.0) + 1.0;  // transformers' derived value, given
  EXPECT_EQ(error_of(j), "");
}

TEST(DrafterConfigInterop, BlockSizeInsideDflashConfig) {
  nlohmann::json j = base_config();
  j.erase("block_size");
  j["dflash_config"]["block_size"] = 10;  // newer z-lab configs nest it (SGLang reads it there first)
  EXPECT_EQ(read(j).block_size, 10);
  j["block_size"] = 10;
  EXPECT_EQ(read(j).block_size, 10);
  j["block_size"] = 16;  // the servers would disagree
  EXPECT_NE(error_of(j).find("block_size 16 and dflash_config.block_size 10 differ"), std::string::npos) << error_of(j);
  j.erase("block_size");
  j["dflash_config"].erase("block_size");
  EXPECT_NE(error_of(j).find("'block_size' is missing"), std::string::npos) << error_of(j);
}

TEST(DrafterConfigInterop, SlidingWindowOnlyWithUseSlidingWindow) {
  nlohmann::json j = base_config();
  j["sliding_window"] = 2048;  // use_sliding_window false: transformers drops it
  DrafterConfig c = read(j);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.layer_window(0), 0);
  // A sliding layer with the window dropped has none: refused, as vLLM refuses it.
  j["layer_types"][0] = "sliding_attention";
  EXPECT_NE(error_of(j).find("sliding_attention layers need sliding_window > 0"), std::string::npos) << error_of(j);
  j["use_sliding_window"] = true;
  c = read(j);
  EXPECT_EQ(c.layer_window(0), 2048);
  EXPECT_EQ(c.layer_window(1), 0);
  // Without layer_types, transformers' Qwen3Config makes layers from max_window_layers on sliding.
  j.erase("layer_types");
  j["max_window_layers"] = 1;
  c = read(j);
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{"full_attention", "sliding_attention", "sliding_attention"}));
  j.erase("max_window_layers");  // default 28: none of 3 layers
  EXPECT_EQ(read(j).layer_types, std::vector<std::string>(3, "full_attention"));
}

TEST(DrafterConfigInterop, VllmDflashConfigKeys) {
  // use_swa with all-full layer_types: every layer sliding, the window from swa_window_size.
  nlohmann::json j = base_config();
  j["dflash_config"]["use_swa"] = true;
  j["dflash_config"]["swa_window_size"] = 512;
  DrafterConfig c = read(j);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(c.is_sliding(i));
    EXPECT_EQ(c.layer_window(i), 512);
    EXPECT_TRUE(c.layer_causal(i));  // a window looks back only
  }
  // use_swa with sliding layers already listed: layer_types decides; swa_window_size before sliding_window.
  j["layer_types"] = {"sliding_attention", "full_attention", "full_attention"};
  j["use_sliding_window"] = true;
  j["sliding_window"] = 2048;
  c = read(j);
  EXPECT_EQ(c.layer_window(0), 512);
  EXPECT_EQ(c.layer_window(1), 0);
  EXPECT_FALSE(c.layer_causal(1));  // a full layer sees its whole block
  // causal: every layer causal inside the block; is_causal wins over it.
  j["dflash_config"]["causal"] = true;
  c = read(j);
  EXPECT_TRUE(c.layer_causal(1));
  EXPECT_EQ(drafter_config_to_json(c)["dflash_config"]["causal"], true);
  EXPECT_EQ(drafter_config_to_json(read(drafter_config_to_json(c))), drafter_config_to_json(c));
  j["is_causal"] = false;
  c = read(j);
  EXPECT_FALSE(c.layer_causal(1));
  EXPECT_TRUE(c.layer_causal(0));  // (the sliding layer stays causal)
  j["dflash_config"]["causal"] = "yes";
  EXPECT_NE(error_of(j).find("'causal' must be true or false"), std::string::npos) << error_of(j);
  j = base_config();
  j["dflash_config"]["attention_sink_bias"] = true;
  EXPECT_NE(error_of(j).find("attention_sink_bias"), std::string::npos) << error_of(j);
}

TEST(DrafterConfigInterop, WhatNoServerWouldServeIsRefused) {
  nlohmann::json j = base_config();
  j["dflash_config"]["target_layer_ids"] = {1, 7, 4};
  EXPECT_NE(error_of(j).find("draft/config.json: target_layer_ids must be strictly increasing (got 7 then 4)"),
            std::string::npos)
      << error_of(j);
  j["dflash_config"]["target_layer_ids"] = {1, 4, 4};
  EXPECT_NE(error_of(j).find("strictly increasing"), std::string::npos) << error_of(j);
  j["dflash_config"]["target_layer_ids"] = {1, 4, 9};  // the 10-layer target's last layer
  EXPECT_NE(error_of(j).find("target layer id 9 is the target's last layer"), std::string::npos) << error_of(j);
  j = base_config();
  j["max_position_embeddings"] = 0;
  EXPECT_NE(error_of(j).find("draft/config.json: max_position_embeddings must be positive"), std::string::npos)
      << error_of(j);
  j["max_position_embeddings"] = -5;
  EXPECT_NE(error_of(j).find("max_position_embeddings"), std::string::npos) << error_of(j);
  j.erase("max_position_embeddings");  // absent: transformers' Qwen3Config default
  EXPECT_EQ(read(j).max_position_embeddings, 32768);
  EXPECT_EQ(error_of(base_config()), "");
}

TEST(DrafterConfigInterop, DefaultTapsNeverTheLastLayer) {
  // Taps that would repeat a layer say how many fit.
  try {
    default_target_layer_ids(6, 5);
    FAIL() << "repeated taps accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("use at most 3 taps (--num-taps)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(default_target_layer_ids(2, 1), (std::vector<int64_t>{0}));
  EXPECT_EQ(default_target_layer_ids(3, 1), (std::vector<int64_t>{1}));
  EXPECT_THROW(default_target_layer_ids(1, 1), std::invalid_argument);
  for (int64_t L = 4; L <= 80; ++L)
    for (int64_t n = 1; n <= std::min<int64_t>(5, L - 3); ++n) EXPECT_LT(default_target_layer_ids(L, n).back(), L - 1) << L << " " << n;
}

namespace {
/// The real Qwen3 tokenizer (BPE and chat template) with the added tokens of the Qwen3.5 / 3.6
/// tokenizer: ids 248044 (<|endoftext|>) .. 248076 (<|audio_pad|>), <|im_end|> its EOS; 248077 ids
/// for an embedding of 248320 rows. Empty when ../shared has no Qwen3 tokenizer.
std::unique_ptr<Tokenizer> qwen35_tokenizer(const test::TempDir& td) {
  const auto dir = test::source_dir() / ".." / "shared" / "tokenizers" / "qwen3";
  if (!std::filesystem::exists(dir / "tokenizer.json")) return nullptr;
  nlohmann::json tj = read_json_file((dir / "tokenizer.json").string());
  const std::vector<std::pair<std::string, bool>> added = {
      {"<|endoftext|>", true}, {"<|im_start|>", true}, {"<|im_end|>", true}, {"<|object_ref_start|>", true},
      {"<|object_ref_end|>", true}, {"<|box_start|>", true}, {"<|box_end|>", true}, {"<|quad_start|>", true},
      {"<|quad_end|>", true}, {"<|vision_start|>", true}, {"<|vision_end|>", true}, {"<|vision_pad|>", true},
      {"<|image_pad|>", true}, {"<|video_pad|>", true}, {"<tool_call>", false}, {"</tool_call>", false},
      {"<|fim_prefix|>", false}, {"<|fim_middle|>", false}, {"<|fim_suffix|>", false}, {"<|fim_pad|>", false},
      {"<|repo_name|>", false}, {"<|file_sep|>", false}, {"<tool_response>", false}, {"</tool_response>", false},
      {"<think>", false}, {"</think>", false}, {"<|audio_start|>", true}, {"<|audio_end|>", true},
      {"<tts_pad>", true}, {"<tts_text_bos>", true}, {"<tts_text_eod>", true}, {"<tts_text_bos_single>", true},
      {"<|audio_pad|>", true}};
  tj["added_tokens"] = nlohmann::json::array();
  for (size_t i = 0; i < added.size(); ++i)
    tj["added_tokens"].push_back({{"id", 248044 + int(i)}, {"content", added[i].first}, {"single_word", false},
                                  {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                                  {"special", added[i].second}});
  test::write_file(td / "tokenizer.json", tj.dump());
  nlohmann::json cfg = read_json_file((dir / "tokenizer_config.json").string());
  cfg.erase("added_tokens_decoder");
  test::write_file(td / "tokenizer_config.json", cfg.dump());
  return Tokenizer::load(td.path().string());
}
}  // namespace

TEST(DrafterConfigInterop, Qwen35MaskTokenIsThePublishedOne) {
  test::TempDir td;
  const auto tok = qwen35_tokenizer(td);
  if (!tok) GTEST_SKIP() << "no Qwen3 tokenizer under ../shared/tokenizers";
  ASSERT_EQ(tok->vocab_size(), 248077);
  ASSERT_EQ(tok->id_to_token(248070), "<|audio_start|>");
  ModelSpec t;
  t.arch = Arch::Qwen3_5;
  t.vocab_size = 248320;  // Qwen3.5 / 3.6 embedding rows
  t.eos_token_ids = {248046, 248044};
  EXPECT_EQ(default_mask_token_id(t, *tok), 248070);  // z-lab's and SpecForge's Qwen3.5 / 3.6 drafters
  // Not a Qwen3.5 target: the rule for the others (the first spare embedding row).
  ModelSpec other = t;
  other.arch = Arch::Qwen3;
  EXPECT_EQ(default_mask_token_id(other, *tok), 248077);
  // The mask is never a token that ends a turn or a sequence, given or chosen.
  for (int64_t stop : {248046, 248044}) {
    try {
      check_mask_token(stop, t, *tok, "drafter config");
      FAIL() << stop << " accepted as the mask";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("ends a turn or a sequence"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(check_mask_token(248070, t, *tok, "drafter config"));
}

TEST(DrafterConfigInterop, MaskTokenIsNeverAnEndOfTurnToken) {
  const auto dir = test::source_dir() / ".." / "shared" / "tokenizers" / "qwen3";
  if (!std::filesystem::exists(dir / "tokenizer.json")) GTEST_SKIP() << "no Qwen3 tokenizer at " << dir;
  const auto tok = Tokenizer::load(dir.string());
  ModelSpec t;
  t.arch = Arch::Qwen3;
  t.vocab_size = tok->vocab_size();  // no spare row: the rule picks among the special tokens
  t.hidden_size = 64, t.intermediate_size = 96, t.num_hidden_layers = 8, t.num_attention_heads = 4;
  t.num_key_value_heads = 2, t.head_dim = 16;
  const int64_t id = default_mask_token_id(t, *tok);
  EXPECT_NE(id, *tok->token_to_id("<|im_end|>"));
  EXPECT_NE(id, *tok->token_to_id("<|endoftext|>"));
  DrafterOverrides o;
  o.num_taps = 1;
  o.mask_token_id = *tok->token_to_id("<|im_end|>");  // the chat template's end of turn, given by hand
  EXPECT_THROW(derive_drafter_config(t, tok.get(), o), std::invalid_argument);
  o.mask_token_id = id;
  EXPECT_EQ(derive_drafter_config(t, tok.get(), o).mask_token_id, id);
}
