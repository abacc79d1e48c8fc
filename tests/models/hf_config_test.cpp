// config.json -> ModelSpec for every supported architecture, and clear errors for bad configs.
#include <gtest/gtest.h>

#include <functional>

#include "models/hf_config.h"
#include "io/json_file.h"
#include "test_util.h"

using namespace dflash;
using nlohmann::json;

namespace {
json dense(const char* arch, const char* mt) {
  return json{{"architectures", {arch}}, {"model_type", mt}, {"vocab_size", 100}, {"hidden_size", 64},
              {"intermediate_size", 96}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
              {"num_key_value_heads", 2}, {"rms_norm_eps", 1e-5}, {"rope_theta", 5e5}, {"eos_token_id", {3, 4}}};
}
std::string error_of(const json& cfg) {
  try {
    model_spec_from_hf_config(cfg, "x/config.json");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(HfConfig, Llama) {
  json c = dense("LlamaForCausalLM", "llama");
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  const ModelSpec s = model_spec_from_hf_config(c, "x");
  EXPECT_EQ(s.arch, Arch::Llama);
  EXPECT_EQ(s.head_dim, 16);
  EXPECT_EQ(s.rotary_dim(), 16);
  EXPECT_EQ(s.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(s.rope.theta, 5e5);
  EXPECT_EQ(s.eos_token_ids, (std::vector<int64_t>{3, 4}));
  EXPECT_FALSE(s.has_qk_norm());
  EXPECT_EQ(s.weight_prefix, "model.");
}

TEST(HfConfig, Qwen3WithRopeParametersAndOwnHeadDim) {
  json c = dense("Qwen3ForCausalLM", "qwen3");
  c.erase("rope_theta");
  c["head_dim"] = 24;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  c["tie_word_embeddings"] = true;
  const ModelSpec s = model_spec_from_hf_config(c, "x");
  EXPECT_EQ(s.arch, Arch::Qwen3);
  EXPECT_EQ(s.head_dim, 24);
  EXPECT_DOUBLE_EQ(s.rope.theta, 1e6);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_TRUE(s.has_qk_norm());
}

TEST(HfConfig, Qwen3_5TextDefaultsAndWrapper) {
  json t = dense("Qwen3_5ForCausalLM", "qwen3_5_text");
  t["num_hidden_layers"] = 8;
  t["head_dim"] = 32;
  t["linear_num_key_heads"] = 2;
  t["linear_num_value_heads"] = 6;
  t["linear_key_head_dim"] = 8;
  t["linear_value_head_dim"] = 12;
  ModelSpec s = model_spec_from_hf_config(t, "x");
  EXPECT_EQ(s.arch, Arch::Qwen3_5);
  EXPECT_EQ(s.rotary_dim(), 8);  // partial_rotary_factor defaults to 0.25
  EXPECT_EQ(s.linear_conv_kernel_dim, 4);
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(s.layer_types[size_t(i)], (i + 1) % 4 == 0 ? LayerKind::Attention : LayerKind::GatedDeltaNet) << i;
  EXPECT_TRUE(s.zero_centered_norm());
  EXPECT_TRUE(s.attn_output_gate());

  json inner = t;
  inner.erase("architectures");
  inner["layer_types"] = {"full_attention", "linear_attention", "linear_attention", "full_attention",
                          "linear_attention", "linear_attention", "linear_attention", "full_attention"};
  json w{{"architectures", {"Qwen3_5ForConditionalGeneration"}}, {"model_type", "qwen3_5"},
         {"text_config", inner}, {"vision_config", {{"depth", 1}}}, {"tie_word_embeddings", true}};
  s = model_spec_from_hf_config(w, "x");
  EXPECT_EQ(s.weight_prefix, "model.language_model.");
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_EQ(s.layer_types[0], LayerKind::Attention);
  EXPECT_EQ(s.layer_types[1], LayerKind::GatedDeltaNet);
}

TEST(HfConfig, ErrorsNameFileAndField) {
  EXPECT_NE(error_of(dense("MistralForCausalLM", "mistral")).find("Qwen3_5ForConditionalGeneration"), std::string::npos);
  EXPECT_NE(error_of(dense("MistralForCausalLM", "mistral")).find("x/config.json"), std::string::npos);
  json c = dense("LlamaForCausalLM", "llama");
  c.erase("hidden_size");
  EXPECT_NE(error_of(c).find("'hidden_size'"), std::string::npos);
  c = dense("LlamaForCausalLM", "llama");
  c["num_key_value_heads"] = 3;
  EXPECT_NE(error_of(c).find("num_key_value_heads"), std::string::npos);
  c = dense("LlamaForCausalLM", "llama");
  c["attention_bias"] = true;
  EXPECT_NE(error_of(c).find("attention_bias"), std::string::npos);
  c = dense("LlamaForCausalLM", "llama");
  c["rope_scaling"] = {{"rope_type", "yarn"}};  // yarn needs its factor
  EXPECT_NE(error_of(c).find("'factor'"), std::string::npos);
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}};
  EXPECT_NE(error_of(c).find("a target with yarn rope scaling is not supported"), std::string::npos);  // drafters only
  c["rope_scaling"] = {{"rope_type", "longrope"}};
  EXPECT_NE(error_of(c).find("rope type 'longrope' is not supported"), std::string::npos);
  c = dense("LlamaForCausalLM", "llama");
  c["hidden_size"] = "64";
  EXPECT_NE(error_of(c).find("hidden_size"), std::string::npos);
  c = dense("Qwen3_5ForCausalLM", "qwen3_5_text");
  c["head_dim"] = 16;
  EXPECT_NE(error_of(c).find("linear_num_key_heads"), std::string::npos);
}

TEST(HfConfig, FileErrors) {
  test::TempDir d;
  EXPECT_THROW(load_hf_config((d / "missing.json").string()), std::runtime_error);
  test::write_file(d / "bad.json", "{\"architectures\": [");
  try {
    load_hf_config((d / "bad.json").string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos);
  }
}

TEST(HfConfig, WrapperTyingIsTheOuterConfigs) {
  json inner = dense("Qwen3_5ForCausalLM", "qwen3_5_text");
  inner.erase("architectures");
  inner["head_dim"] = 16;
  inner["linear_num_key_heads"] = 2;
  inner["linear_num_value_heads"] = 2;
  inner["linear_key_head_dim"] = 8;
  inner["linear_value_head_dim"] = 8;
  inner["tie_word_embeddings"] = true;  // ignored: Qwen3_5Config owns tying (default false)
  json w{{"architectures", {"Qwen3_5ForConditionalGeneration"}}, {"model_type", "qwen3_5"}, {"text_config", inner}};
  EXPECT_FALSE(model_spec_from_hf_config(w, "x").tie_word_embeddings);
}

TEST(HfConfig, QwenConfigsMustStateHeadShapeAndLlama3FieldsAreRequired) {
  json c = dense("Qwen3ForCausalLM", "qwen3");
  EXPECT_NE(error_of(c).find("'head_dim'"), std::string::npos);
  c["head_dim"] = 16;
  c.erase("num_key_value_heads");
  EXPECT_NE(error_of(c).find("'num_key_value_heads'"), std::string::npos);
  c = dense("LlamaForCausalLM", "llama");
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  EXPECT_NE(error_of(c).find("low_freq_factor"), std::string::npos);
  c = dense("LlamaForCausalLM", "llama");
  c["num_hidden_layers"] = 100000000;
  EXPECT_NE(error_of(c).find("num_hidden_layers"), std::string::npos);
}

// Found by fuzz/config_json_fuzz: max_position_embeddings past int64 (parsed as a float) was cast to
// an integer with undefined behaviour; now integer fields of config.json must hold integers.
TEST(HfConfig, HugeNumberInAnIntegerFieldIsRefused) {
  const auto j = read_json_file(
      (test::source_dir() / "fuzz" / "regressions" / "config_json_fuzz" / "float_max_position_embeddings_model.json").string());
  try {
    (void)model_spec_from_hf_config(j, "regression");
    FAIL() << "accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("max_position_embeddings"), std::string::npos) << e.what();
  }
}

// Mixture-of-experts configs (Qwen3.5-MoE, Qwen3-Next): the fixtures parse; hostile values are clear
// errors, found before any allocation that scales with them.
TEST(HfConfig, MixtureOfExpertsFieldsAndTheirErrors) {
  const json next = read_json_file((test::fixtures_dir() / "qwen3_next" / "config.json").string());
  const json moe = read_json_file((test::fixtures_dir() / "qwen3_5_moe" / "config.json").string());
  const ModelSpec n = model_spec_from_hf_config(next, "next");
  EXPECT_EQ(n.architecture, "Qwen3NextForCausalLM");
  EXPECT_TRUE(n.gdn_fused_projections);
  EXPECT_EQ(n.mlp_only_layers, (std::vector<int64_t>{1}));
  EXPECT_TRUE(n.is_moe_layer(0) && !n.is_moe_layer(1) && n.is_moe_layer(2));
  const ModelSpec m = model_spec_from_hf_config(moe, "moe");
  EXPECT_EQ(m.architecture, "Qwen3_5MoeForConditionalGeneration");
  EXPECT_EQ(m.intermediate_size, 0);  // no dense MLP
  EXPECT_TRUE(m.norm_topk_prob);
  auto edited = [](json c, const std::function<void(json&)>& f) {
    f(c.contains("text_config") ? c["text_config"] : c);
    return error_of(c);
  };
  EXPECT_NE(edited(moe, [](json& t) { t["num_experts"] = -6; }).find("num_experts must be positive"), std::string::npos);
  EXPECT_NE(edited(next, [](json& t) { t["num_experts"] = -6; }).find("num_experts must not be negative"),
            std::string::npos);
  EXPECT_NE(edited(next, [](json& t) { t["mlp_only_layers"] = {99}; }).find("mlp_only_layers holds layer 99"),
            std::string::npos);
  EXPECT_NE(edited(next, [](json& t) { t["mlp_only_layers"] = "1"; }).find("must be a list"), std::string::npos);
  EXPECT_NE(edited(next, [](json& t) { t["num_experts_per_tok"] = 7; }).find("num_experts_per_tok"), std::string::npos);
  EXPECT_NE(edited(moe, [](json& t) { t["shared_expert_intermediate_size"] = int64_t(1) << 50; })
                .find("shared_expert_intermediate_size"),
            std::string::npos);
  json huge = next;
  huge.erase("layer_types");
  huge["num_hidden_layers"] = int64_t(1) << 40;
  EXPECT_NE(error_of(huge).find("num_hidden_layers must be in [1, 4096]"), std::string::npos);
  huge = next;
  huge["num_hidden_layers"] = int64_t(1) << 40;  // with an explicit layer list: no walk over 2^40 layers
  EXPECT_NE(error_of(huge).find("num_hidden_layers"), std::string::npos);
}
