// Chat templates: native renders against transformers' renders of the real templates
// (tests/fixtures/chat/*.json from scripts/chat_goldens.py), assistant masks, detection, errors.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"
#include "text/chat_template.h"

using namespace dflash;
using nlohmann::json;

namespace {

std::filesystem::path chat_dir() { return test::fixtures_dir() / "chat"; }

std::string read_text(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error(p.string() + ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json read_golden(const std::string& name) { return json::parse(read_text(chat_dir() / (name + ".json"))); }

std::vector<ChatMessage> messages_of(const json& j) {
  std::vector<ChatMessage> out;
  for (const json& m : j) {
    ChatMessage msg{m.at("role").get<std::string>(), m.at("content").get<std::string>(), std::nullopt};
    if (m.contains("reasoning_content")) msg.reasoning_content = m["reasoning_content"].get<std::string>();
    out.push_back(std::move(msg));
  }
  return out;
}

ChatOptions options_of(const json& c) {
  ChatOptions o;
  o.add_generation_prompt = c.at("add_generation_prompt").get<bool>();
  if (c.contains("enable_thinking")) o.enable_thinking = c["enable_thinking"].get<bool>();
  return o;
}

std::string case_label(const json& conv, const json& r) {
  std::string s = conv.at("name").get<std::string>() + " gen=" + (r["add_generation_prompt"].get<bool>() ? "1" : "0");
  if (r.contains("enable_thinking")) s += std::string(" thinking=") + (r["enable_thinking"].get<bool>() ? "1" : "0");
  return s;
}

/// Calls fn(label, messages, options, render) for every render of every conversation of a golden file.
template <class Fn>
void for_each_render(const json& golden, Fn fn) {
  for (const json& conv : golden.at("conversations")) {
    const std::vector<ChatMessage> msgs = messages_of(conv.at("messages"));
    for (const json& r : conv.at("renders")) fn(case_label(conv, r), msgs, options_of(r), r);
  }
}

/// The end-of-turn token and the assistant header of a family.
std::pair<std::string, std::string> end_and_header(ChatFamily f) {
  if (f == ChatFamily::Llama3 || f == ChatFamily::Llama3_1)
    return {"<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"};
  return {"<|im_end|>", "<|im_start|>assistant\n"};
}

// The golden files: one per real template (several templates map to one family).
const std::vector<std::string> kGoldens = {"qwen3",   "qwen3.5", "qwen3.6",  "qwen3.5-0.8b", "smollm2",
                                           "chatml",  "llama3",  "llama3.1", "llama3.2"};

class ChatGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    golden_ = read_golden(GetParam());
    family_ = chat_family_from_name(golden_.at("family").get<std::string>());
    ASSERT_GE(golden_.at("conversations").size(), 10u);
  }
  json golden_;
  ChatFamily family_{};
};

TEST_P(ChatGolden, TextMatchesTransformers) {
  int n = 0;
  for_each_render(golden_, [&](const std::string& label, const auto& msgs, const ChatOptions& opt, const json& r) {
    ++n;
    if (r.contains("error"))
      EXPECT_THROW(render_chat_text(family_, msgs, opt), std::invalid_argument) << label;
    else
      EXPECT_EQ(render_chat_text(family_, msgs, opt), r["text"].get<std::string>()) << label;
  });
  EXPECT_GE(n, 40);
}

// Segments concatenate to the text, alternate flags, and the assistant ones are exactly each assistant
// turn's body: from right after its header through its (first) end-of-turn token.
TEST_P(ChatGolden, AssistantSegmentsAreExactlyTheAssistantTurns) {
  const auto [end, header] = end_and_header(family_);
  for_each_render(golden_, [&](const std::string& label, const auto& msgs, const ChatOptions& opt, const json& r) {
    if (r.contains("error")) return;
    const std::vector<ChatSegment> segs = render_chat(family_, msgs, opt);
    std::string text;
    size_t n_assistant = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      const ChatSegment& s = segs[i];
      EXPECT_FALSE(s.text.empty()) << label;
      if (i > 0) {
        EXPECT_NE(s.assistant, segs[i - 1].assistant) << label;
      }
      if (s.assistant) {
        ++n_assistant;
        EXPECT_TRUE(text.ends_with(header)) << label << ": segment " << i;
        EXPECT_TRUE(s.text.ends_with(end)) << label << ": segment " << i;
        EXPECT_EQ(s.text.find(end), s.text.size() - end.size()) << label << ": segment " << i;
      }
      text += s.text;
    }
    EXPECT_EQ(text, r["text"].get<std::string>()) << label;
    size_t n_msgs = 0;
    for (const ChatMessage& m : msgs) n_msgs += m.role == "assistant";
    EXPECT_EQ(n_assistant, n_msgs) << label;
  });
}

TEST_P(ChatGolden, DetectsTheRealTemplate) {
  const std::string tmpl = read_text(chat_dir() / golden_.at("template").get<std::string>());
  EXPECT_EQ(detect_chat_family(tmpl), family_);
}

INSTANTIATE_TEST_SUITE_P(Chat, ChatGolden, ::testing::ValuesIn(kGoldens), [](const auto& info) {
  std::string s = info.param;
  for (char& ch : s)
    if (ch == '.' || ch == '-') ch = '_';
  return s;
});

std::string template_file(const std::string& name) { return read_text(chat_dir() / "templates" / name); }

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t p = 0; (p = s.find(from, p)) != std::string::npos; p += to.size()) s.replace(p, from.size(), to);
}

TEST(ChatTemplate, SegmentsOfAQwen3Conversation) {
  const std::vector<ChatMessage> msgs = {
      {"system", "S", std::nullopt}, {"user", "q", std::nullopt}, {"assistant", "a", std::string("r")}};
  ChatOptions opt;
  opt.add_generation_prompt = true;
  const std::vector<ChatSegment> segs = render_chat(ChatFamily::Qwen3, msgs, opt);
  ASSERT_EQ(segs.size(), 3u);
  EXPECT_EQ(segs[0].text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_FALSE(segs[0].assistant);
  EXPECT_EQ(segs[1].text, "<think>\nr\n</think>\n\na<|im_end|>");
  EXPECT_TRUE(segs[1].assistant);
  EXPECT_EQ(segs[2].text, "\n<|im_start|>assistant\n");
  EXPECT_FALSE(segs[2].assistant);
}

TEST(ChatTemplate, SegmentsOfALlama3_1Conversation) {
  const std::vector<ChatMessage> msgs = {{"user", " hi ", std::nullopt}, {"assistant", "\nhello\n", std::nullopt}};
  const std::vector<ChatSegment> segs = render_chat(ChatFamily::Llama3_1, msgs);
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(segs[0].text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(segs[1].text, "hello<|eot_id|>");
  EXPECT_TRUE(segs[1].assistant);
}

// Fingerprints do not depend on formatting: the templates as stored in tokenizer_config.json (escaped
// newlines) and with real newlines, re-indented, are recognized alike.
TEST(ChatTemplate, DetectionIgnoresFormatting) {
  std::string q = template_file("qwen3.jinja");
  replace_all(q, "\\n", "\n");
  replace_all(q, "    ", "\t");
  EXPECT_EQ(detect_chat_family(q), ChatFamily::Qwen3);
  std::string s = template_file("smollm2.jinja");
  replace_all(s, "\n", "\\n");
  EXPECT_EQ(detect_chat_family(s), ChatFamily::SmolLM2);
  EXPECT_EQ(detect_chat_family("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                               "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                               "{{ '<|im_start|>assistant\\n' }}{% endif %}"),
            ChatFamily::ChatML);
}

void expect_unknown(const std::string& tmpl) {
  try {
    detect_chat_family(tmpl);
    ADD_FAILURE() << "detected: " << tmpl.substr(0, 80);
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--chat-template"), std::string::npos) << what;
    for (const char* name : {"qwen3", "qwen3.5", "smollm2", "chatml", "llama3", "llama3.1"})
      EXPECT_NE(what.find(name), std::string::npos) << what;
  }
}

TEST(ChatTemplate, UnknownTemplatesAreErrors) {
  expect_unknown("");
  expect_unknown("{{ bos_token }}{% for message in messages %}[INST] {{ message['content'] }} [/INST]{% endfor %}");
  // ChatML with a default system prompt (Qwen1.5/2.5 style) is not plain ChatML.
  expect_unknown("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
                 "{% endfor %}");
  // Qwen3.5 with the think condition changed (a later template's preserve_thinking default).
  std::string q = template_file("qwen3.6-27b.jinja");
  replace_all(q, "(preserve_thinking is defined and preserve_thinking is true)",
              "preserve_thinking is undefined or preserve_thinking is true");
  expect_unknown(q);
  // Qwen3 without the enable_thinking switch (e.g. a thinking-only variant).
  std::string q3 = template_file("qwen3.jinja");
  replace_all(q3, "enable_thinking is defined and enable_thinking is false", "true");
  expect_unknown(q3);
}

TEST(ChatTemplate, Names) {
  for (const char* name : {"qwen3", "qwen3.5", "qwen3.5-nothink", "smollm2", "chatml", "llama3", "llama3.1"})
    EXPECT_EQ(chat_family_name(chat_family_from_name(name)), name);
  EXPECT_EQ(chat_family_from_name("qwen3.6"), ChatFamily::Qwen3_5);
  try {
    chat_family_from_name("vicuna");
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("llama3.1"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplate, BadRolesAndEmptyConversations) {
  for (ChatFamily f : {ChatFamily::Qwen3, ChatFamily::Qwen3_5, ChatFamily::Qwen3_5NoThink, ChatFamily::SmolLM2,
                       ChatFamily::ChatML, ChatFamily::Llama3, ChatFamily::Llama3_1}) {
    EXPECT_THROW(render_chat(f, {}), std::invalid_argument);
    try {
      render_chat(f, {{"user", "q", std::nullopt}, {"tool", "42", std::nullopt}});
      ADD_FAILURE() << chat_family_name(f);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("'tool'"), std::string::npos) << e.what();
    }
  }
}

TEST(ChatTemplate, Qwen3_5TemplateErrors) {
  EXPECT_THROW(render_chat(ChatFamily::Qwen3_5, {{"assistant", "a", std::nullopt}}), std::invalid_argument);
  EXPECT_THROW(render_chat(ChatFamily::Qwen3_5, {{"user", "<tool_response>x</tool_response>", std::nullopt}}),
               std::invalid_argument);
  EXPECT_THROW(render_chat(ChatFamily::Qwen3_5, {{"user", "q", std::nullopt}, {"system", "s", std::nullopt}}),
               std::invalid_argument);
}

// Python's str.strip() whitespace (Jinja's trim) is Unicode-aware; malformed UTF-8 is kept as is.
TEST(ChatTemplate, TrimFollowsPython) {
  const std::string nbsp = "\xC2\xA0", ideo = "\xE3\x80\x80", bad = "\xFF";
  const std::vector<ChatMessage> msgs = {{"user", nbsp + ideo + " x " + ideo + "\x1F", std::nullopt},
                                         {"assistant", bad + " y " + bad, std::nullopt}};
  const std::string t = render_chat_text(ChatFamily::Llama3, msgs);
  EXPECT_EQ(t, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n" + bad + " y " + bad + "<|eot_id|>");
}

}  // namespace
