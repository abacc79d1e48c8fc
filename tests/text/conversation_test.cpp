// Whole conversations end to end against transformers' apply_chat_template(tokenize=True) with the real
// Qwen3 tokenizer (tests/fixtures/chat/qwen3_ids.json, scripts/conversation_ids_goldens.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "text/sample.h"
#include "text/tokenizer.h"
#include "test_util.h"

using namespace dflash;

TEST(Conversation, Qwen3IdsMatchTransformersApplyChatTemplate) {
  const auto tok_dir = test::source_dir() / ".." / "shared" / "tokenizers" / "qwen3";
  if (!std::filesystem::exists(tok_dir / "tokenizer.json"))
    GTEST_SKIP() << "the Qwen3 tokenizer is not at " << tok_dir << " (../shared beside the checkout)";
  const auto tok = Tokenizer::load(tok_dir.string());
  EXPECT_EQ(detect_chat_family(tok->chat_template()), ChatFamily::Qwen3);
  std::ifstream f(test::fixtures_dir() / "chat" / "qwen3_ids.json");
  const auto g = nlohmann::json::parse(f);
  ASSERT_GE(g["cases"].size(), 10u);
  for (const auto& c : g["cases"]) {
    std::vector<ChatMessage> msgs;
    for (const auto& m : c["messages"]) {
      ChatMessage cm{m["role"], m["content"], std::nullopt};
      if (m.contains("reasoning_content") && m["reasoning_content"].is_string()) cm.reasoning_content = m["reasoning_content"];
      msgs.push_back(cm);
    }
    ChatOptions opt;
    opt.add_generation_prompt = c["options"].value("add_generation_prompt", false);
    if (c["options"].contains("enable_thinking")) opt.enable_thinking = c["options"]["enable_thinking"].get<bool>();
    EXPECT_EQ(tok->encode(render_chat_text(ChatFamily::Qwen3, msgs, opt), false), c["ids"].get<std::vector<int32_t>>())
        << c["name"] << " " << c["options"].dump();
  }
}

TEST(Conversation, LossMaskKeepsAssistantBytesAcrossTheHeaderBoundary) {
  const auto tok_dir = test::source_dir() / ".." / "shared" / "tokenizers" / "qwen3";
  if (!std::filesystem::exists(tok_dir / "tokenizer.json"))
    GTEST_SKIP() << "the Qwen3 tokenizer is not at " << tok_dir << " (../shared beside the checkout)";
  const auto tok = Tokenizer::load(tok_dir.string());
  // "\n\nHello" after the header's "\n" tokenizes as "\n\n\n" + "Hello": that token carries content.
  Conversation c;
  c.messages = {{"user", "Hi", std::nullopt}, {"assistant", "\n\nHello", std::nullopt}, {"user", "More", std::nullopt},
                {"assistant", "Sure", std::nullopt}};
  bool truncated = false;
  const Sample s = build_sample(*tok, ChatFamily::Qwen3, c, 0, &truncated);
  std::vector<int32_t> masked;
  for (size_t i = 0; i < s.ids.size(); ++i)
    if (s.loss_mask[i]) masked.push_back(s.ids[i]);
  const std::string text = tok->decode(masked);
  EXPECT_NE(text.find("\n\nHello<|im_end|>"), std::string::npos) << text;
  EXPECT_NE(text.find("Sure<|im_end|>"), std::string::npos) << text;
  EXPECT_EQ(text.find("Hi"), std::string::npos) << text;
  EXPECT_EQ(text.find("More"), std::string::npos) << text;
  EXPECT_EQ(text.find("user"), std::string::npos) << text;
}
