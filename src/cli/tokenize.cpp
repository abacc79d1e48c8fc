// `dflash tokenize`: token ids of a text or of a whole rendered conversation, as one JSON line.
#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "text/prepare.h"
#include "io/json_file.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace dflash::cli {

namespace {

std::vector<ChatMessage> read_messages(const std::string& path) {
  nlohmann::json j = read_json_file(path);
  if (j.is_object() && j.contains("messages")) j = j["messages"];
  if (!j.is_array()) throw std::runtime_error(path + ": expected a list of {\"role\", \"content\"} messages");
  std::vector<ChatMessage> m;
  for (const auto& x : j) {
    if (!x.is_object() || !x.contains("role") || !x["role"].is_string() || !x.contains("content") ||
        !x["content"].is_string())
      throw std::runtime_error(path + ": message " + std::to_string(m.size() + 1) +
                               " needs string \"role\" and \"content\"");
    ChatMessage msg{x["role"], x["content"], std::nullopt};
    if (x.contains("reasoning_content") && x["reasoning_content"].is_string()) msg.reasoning_content = x["reasoning_content"];
    m.push_back(std::move(msg));
  }
  return m;
}

}  // namespace

void add_tokenize(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("tokenize", "Print the token ids of a text or a conversation as one JSON line");
  static std::string tok_path, text, chat, chat_template;
  static bool add_special = false;
  cmd->add_option("--tokenizer", tok_path, "tokenizer.json, a directory holding one, or a .gguf")->required();
  static CLI::Option* t = cmd->add_option("--text", text, "Text to encode");
  static CLI::Option* c = cmd->add_option("--chat", chat, "JSON file with a messages list; the whole conversation is rendered");
  t->excludes(c);
  cmd->add_option("--chat-template", chat_template, "Template family for --chat (default: detected)");
  cmd->add_flag("--add-special-tokens", add_special, "With --text: add the tokenizer's BOS/EOS as its post-processor says");
  cmd->callback([&run] {
    run = [] {
      if (!t->count() && !c->count()) throw std::runtime_error("tokenize: give --text S or --chat FILE.json");
      const auto tok = Tokenizer::load(tok_path);
      std::vector<int32_t> ids;
      if (c->count()) {
        const ChatFamily f = chat_family_for(*tok, chat_template, tok_path);
        ids = tok->encode(render_chat_text(f, read_messages(chat)), false);
      } else {
        ids = tok->encode(text, add_special);
      }
      fmt::print("{}\n", nlohmann::json(ids).dump());
      return 0;
    };
  });
}

}  // namespace dflash::cli
