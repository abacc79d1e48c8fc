#include "text/dataset.h"

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace dflash {

namespace {

using nlohmann::json;

/// Raised for a bad record; carries only the reason (the caller adds file:line).
struct BadRecord : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const std::string& str_field(const json& j, const char* key, const char* what) {
  auto it = j.find(key);
  if (it == j.end()) throw BadRecord(std::string(what) + ": missing \"" + key + "\"");
  if (!it->is_string()) throw BadRecord(std::string(what) + ": \"" + key + "\" is not a string");
  return it->get_ref<const std::string&>();
}

std::string role_from_sharegpt(const std::string& from) {
  if (from == "human" || from == "user") return "user";
  if (from == "gpt" || from == "assistant" || from == "chatgpt" || from == "bard" || from == "model") return "assistant";
  if (from == "system") return "system";
  throw BadRecord("unknown ShareGPT speaker \"" + from + "\" (expected human, gpt or system)");
}

void add_message(Conversation& c, std::string role, std::string content,
                 std::optional<std::string> reasoning = std::nullopt) {
  if (!is_supported_role(role)) throw BadRecord("unknown role \"" + role + "\" (expected system, user or assistant)");
  if (content.find_first_not_of(" \t\r\n") == std::string::npos)
    throw BadRecord("empty " + role + " turn (message " + std::to_string(c.messages.size() + 1) + ")");
  c.messages.push_back({std::move(role), std::move(content), std::move(reasoning)});
}

Conversation from_json(const json& j) {
  if (!j.is_object()) throw BadRecord("record is not a JSON object");
  Conversation c;
  if (auto it = j.find("messages"); it != j.end()) {
    if (!it->is_array()) throw BadRecord("\"messages\" is not a list");
    for (const auto& m : *it) {
      if (!m.is_object()) throw BadRecord("a message is not an object");
      std::optional<std::string> reasoning;  // Qwen3 / Qwen3.5 thinking given apart from the content
      if (auto r = m.find("reasoning_content"); r != m.end() && !r->is_null())
        reasoning = str_field(m, "reasoning_content", "message");
      add_message(c, str_field(m, "role", "message"), str_field(m, "content", "message"), std::move(reasoning));
    }
  } else if (auto it = j.find("conversations"); it != j.end()) {
    if (!it->is_array()) throw BadRecord("\"conversations\" is not a list");
    for (const auto& m : *it) {
      if (!m.is_object()) throw BadRecord("a ShareGPT turn is not an object");
      add_message(c, role_from_sharegpt(str_field(m, "from", "ShareGPT turn")), str_field(m, "value", "ShareGPT turn"));
    }
  } else if (auto it = j.find("turns"); it != j.end()) {
    if (!it->is_array()) throw BadRecord("\"turns\" is not a list");
    for (const auto& t : *it) {
      if (!t.is_string()) throw BadRecord("a turn is not a string");
      add_message(c, "user", t.get<std::string>());
    }
  } else if (j.contains("question") || j.contains("prompt")) {
    const char* key = j.contains("question") ? "question" : "prompt";
    add_message(c, "user", str_field(j, key, "record"));
    for (const char* ans : {"answer", "response", "completion"})
      if (j.contains(ans)) {
        add_message(c, "assistant", str_field(j, ans, "record"));
        break;
      }
  } else {
    throw BadRecord("unknown record layout (expected \"messages\", \"conversations\", \"turns\", \"question\" or \"prompt\")");
  }
  if (c.messages.empty()) throw BadRecord("conversation has no turns");
  c.prompt_only = true;
  for (const auto& m : c.messages) c.prompt_only = c.prompt_only && m.role != "assistant";
  return c;
}

}  // namespace

void read_chat_file(const std::string& path, bool strict, const std::function<void(Conversation&&)>& on_record,
                    std::vector<SkippedRecord>& skipped, const std::function<bool()>& stop) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open data file");
  auto handle = [&](int64_t line, const std::function<json()>& parse) {
    if (stop && stop()) throw std::runtime_error("interrupted");
    try {
      Conversation c = from_json(parse());
      c.file = path;
      c.line = line;
      on_record(std::move(c));
    } catch (const BadRecord& e) {
      if (strict) throw std::runtime_error(path + ":" + std::to_string(line) + ": " + e.what());
      skipped.push_back({path, line, e.what()});
    } catch (const json::exception& e) {
      const std::string why = std::string("invalid JSON: ") + e.what();
      if (strict) throw std::runtime_error(path + ":" + std::to_string(line) + ": " + why);
      skipped.push_back({path, line, why});
    }
  };
  // Skip a UTF-8 byte order mark; then a JSON array when the first non-space character is '[',
  // JSONL otherwise.
  char bom[3] = {};
  if (!(f.read(bom, 3) && bom[0] == '\xEF' && bom[1] == '\xBB' && bom[2] == '\xBF')) {
    f.clear();
    f.seekg(0);
  }
  char first = 0;
  while (f.get(first) && std::isspace(static_cast<unsigned char>(first))) {
  }
  if (!f) return;  // empty file: no records
  f.unget();
  if (first == '[') {
    // Streamed: each element is handed over as soon as it is parsed and then dropped (the parser
    // callback returns false for it), so the array never exists whole in memory. Elements count
    // as "lines" 1, 2, ...
    int64_t index = 0;
    const json::parser_callback_t each = [&](int depth, json::parse_event_t event, json& parsed) {
      const bool element_done = depth == 1 && (event == json::parse_event_t::object_end ||
                                               event == json::parse_event_t::array_end ||
                                               event == json::parse_event_t::value);
      if (!element_done) return true;
      handle(++index, [&] { return std::move(parsed); });
      return false;
    };
    try {
      [[maybe_unused]] const json rest = json::parse(f, each);  // an empty array: the callback took every element
    } catch (const json::exception& e) {
      throw std::runtime_error(path + ": invalid JSON array after element " + std::to_string(index) + ": " + e.what());
    }
    return;
  }
  std::string text;
  for (int64_t line = 1; std::getline(f, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    handle(line, [&] { return json::parse(text); });
  }
}

}  // namespace dflash
