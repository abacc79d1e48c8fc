// Native renderers of the supported chat-template families. Each mirrors the real Jinja template
// (tests/fixtures/chat/templates) line by line, including Python's string semantics (str.strip() for
// Jinja's `trim`, split/lstrip/rstrip with '\n'); tests/fixtures/chat/*.json are transformers' renders.
#include "text/chat_template.h"

#include <array>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <tuple>
#include <utility>

namespace dflash {

namespace {

// ---------------------------------------------------------------------------------------------
// Python string semantics

/// str.isspace() for one code point.
bool is_py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

/// Decodes the UTF-8 code point of s starting at i into *cp; returns its length, or 0 when malformed.
size_t decode_utf8(std::string_view s, size_t i, char32_t* cp) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  char32_t c = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < n; ++k) {
    const auto cb = static_cast<unsigned char>(s[i + k]);
    if ((cb & 0xC0) != 0x80) return 0;
    c = (c << 6) | (cb & 0x3F);
  }
  *cp = c;
  return n;
}

/// Length of the Python-whitespace prefix of s.
size_t space_prefix(std::string_view s) {
  size_t i = 0;
  char32_t c = 0;
  while (i < s.size()) {
    const size_t n = decode_utf8(s, i, &c);
    if (n == 0 || !is_py_space(c)) break;
    i += n;
  }
  return i;
}

/// Length of the Python-whitespace suffix of s.
size_t space_suffix(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;  // back over continuation bytes to the code point's lead byte
    while (start > 0 && end - start < 4 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    char32_t c = 0;
    if (decode_utf8(s, start, &c) != end - start || !is_py_space(c)) break;
    end = start;
  }
  return s.size() - end;
}

/// Jinja's `trim` filter: Python's str.strip() (Unicode whitespace).
std::string py_strip(std::string_view s) {
  const size_t head = space_prefix(s);
  if (head == s.size()) return {};
  s.remove_prefix(head);
  s.remove_suffix(space_suffix(s));
  return std::string(s);
}

std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
std::string_view strip_nl(std::string_view s) { return rstrip_nl(lstrip_nl(s)); }

/// s.split(sep)[0]
std::string_view before_first(std::string_view s, std::string_view sep) {
  const size_t p = s.find(sep);
  return p == std::string_view::npos ? s : s.substr(0, p);
}
/// s.split(sep)[-1]
std::string_view after_last(std::string_view s, std::string_view sep) {
  const size_t p = s.rfind(sep);
  return p == std::string_view::npos ? s : s.substr(p + sep.size());
}

bool contains(std::string_view s, std::string_view sub) { return s.find(sub) != std::string_view::npos; }

// ---------------------------------------------------------------------------------------------
// Rendering

/// Collects segments, merging neighbours with the same flag.
class Segments {
 public:
  void add(std::string_view text, bool assistant) {
    if (text.empty()) return;
    if (!out_.empty() && out_.back().assistant == assistant)
      out_.back().text += text;
    else
      out_.push_back({std::string(text), assistant});
  }
  std::vector<ChatSegment> take() { return std::move(out_); }

 private:
  std::vector<ChatSegment> out_;
};

void check_messages(const std::vector<ChatMessage>& m) {
  if (m.empty()) throw std::invalid_argument("chat template: the conversation has no messages");
  for (size_t i = 0; i < m.size(); ++i) {
    const std::string& r = m[i].role;
    if (!is_supported_role(r))
      throw std::invalid_argument("chat template: message " + std::to_string(i) + " has role '" + r +
                                  "'; only system, user and assistant are supported (no tool calls)");
  }
}

constexpr std::string_view kImStart = "<|im_start|>", kImEnd = "<|im_end|>";

/// A ChatML turn: header and "\n" plain, content + <|im_end|> flagged when it is an assistant's.
void chatml_turn(Segments& out, const std::string& role, std::string_view body) {
  out.add(std::string(kImStart) + role + "\n", false);
  out.add(std::string(body) + std::string(kImEnd), role == "assistant");
  out.add("\n", false);
}

/// Plain ChatML (transformers' docs template) and SmolLM2 (same, plus a default system turn).
void render_chatml(Segments& out, const std::vector<ChatMessage>& m, const ChatOptions& opt, bool smollm2) {
  if (smollm2 && m[0].role != "system")
    chatml_turn(out, "system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  for (const ChatMessage& msg : m) chatml_turn(out, msg.role, msg.content);
  if (opt.add_generation_prompt) out.add("<|im_start|>assistant\n", false);
}

/// Index of the last user message that is a real query (not a wrapped tool response), as the Qwen
/// templates compute `ns.last_query_index`; `trimmed`: Qwen3.5 tests the trimmed content. -1: none.
long last_query_index(const std::vector<ChatMessage>& m, bool trimmed) {
  for (size_t k = m.size(); k-- > 0;) {
    if (m[k].role != "user") continue;
    const std::string c = trimmed ? py_strip(m[k].content) : m[k].content;
    const std::string_view v = c;
    if (!(v.starts_with("<tool_response>") && v.ends_with("</tool_response>"))) return long(k);
  }
  return -1;
}

/// Reasoning and answer of an assistant turn, split at </think> as the Qwen templates do when no
/// reasoning_content is given.
std::pair<std::string, std::string> split_think(std::string_view content) {
  const std::string_view reasoning = lstrip_nl(after_last(rstrip_nl(before_first(content, "</think>")), "<think>"));
  return {std::string(reasoning), std::string(lstrip_nl(after_last(content, "</think>")))};
}

/// Qwen3's assistant body (between the header and <|im_end|>).
std::string qwen3_assistant(const ChatMessage& msg, bool after_query, bool last) {
  std::string content = msg.content, reasoning;
  if (msg.reasoning_content)
    reasoning = *msg.reasoning_content;
  else if (contains(content, "</think>"))
    std::tie(reasoning, content) = split_think(msg.content);
  if (after_query && (last || !reasoning.empty()))
    return "<think>\n" + std::string(strip_nl(reasoning)) + "\n</think>\n\n" + std::string(lstrip_nl(content));
  return content;
}

void render_qwen3(Segments& out, const std::vector<ChatMessage>& m, const ChatOptions& opt) {
  long last_query = last_query_index(m, false);
  if (last_query < 0) last_query = long(m.size()) - 1;  // the template's initial value
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "assistant")
      chatml_turn(out, msg.role, qwen3_assistant(msg, long(i) > last_query, i + 1 == m.size()));
    else
      chatml_turn(out, msg.role, msg.content);  // a first system turn renders the same way
  }
  if (opt.add_generation_prompt) {
    out.add("<|im_start|>assistant\n", false);
    if (opt.enable_thinking == false) out.add("<think>\n\n</think>\n\n", false);
  }
}

/// Qwen3.5's assistant body: content trimmed; the think block on every turn after the last query.
std::string qwen3_5_assistant(const ChatMessage& msg, bool after_query) {
  std::string content = py_strip(msg.content), reasoning;
  if (msg.reasoning_content)
    reasoning = *msg.reasoning_content;
  else if (contains(content, "</think>"))
    std::tie(reasoning, content) = split_think(content);
  if (after_query) return "<think>\n" + py_strip(reasoning) + "\n</think>\n\n" + content;
  return content;
}

/// Qwen3.5 / Qwen3.6 (preserve_thinking unset); `thinking_default`: the generation prompt's thinking
/// mode when enable_thinking is not given (off for Qwen3.5-0.8B's template).
void render_qwen3_5(Segments& out, const std::vector<ChatMessage>& m, const ChatOptions& opt,
                    bool thinking_default) {
  const long last_query = last_query_index(m, true);
  if (last_query < 0) throw std::invalid_argument("qwen3.5 chat template: No user query found in messages.");
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "system" && i > 0)
      throw std::invalid_argument("qwen3.5 chat template: System message must be at the beginning.");
    if (msg.role == "assistant")
      chatml_turn(out, msg.role, qwen3_5_assistant(msg, long(i) > last_query));
    else
      chatml_turn(out, msg.role, py_strip(msg.content));
  }
  if (opt.add_generation_prompt) {
    out.add("<|im_start|>assistant\n", false);
    out.add(opt.enable_thinking.value_or(thinking_default) ? "<think>\n" : "<think>\n\n</think>\n\n", false);
  }
}

constexpr std::string_view kBeginOfText = "<|begin_of_text|>", kEot = "<|eot_id|>";

/// A Llama 3 turn: header plain, trimmed content + <|eot_id|> flagged when it is an assistant's.
void llama_turn(Segments& out, const std::string& role, std::string_view content) {
  out.add("<|start_header_id|>" + role + "<|end_header_id|>\n\n", false);
  out.add(py_strip(content) + std::string(kEot), role == "assistant");
}

/// Llama 3.0; `with_date_header`: Llama 3.1+, whose system turn (always written) starts with the
/// knowledge-cutoff and date lines and holds the first message when that is a system one.
void render_llama3(Segments& out, const std::vector<ChatMessage>& m, const ChatOptions& opt, bool with_date_header) {
  out.add(kBeginOfText, false);
  size_t first = 0;
  if (with_date_header) {
    const bool has_system = m[0].role == "system";
    out.add("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\n" +
                (has_system ? py_strip(m[0].content) : std::string()) + std::string(kEot),
            false);
    first = has_system ? 1 : 0;
  }
  for (size_t i = first; i < m.size(); ++i) llama_turn(out, m[i].role, m[i].content);
  if (opt.add_generation_prompt) out.add("<|start_header_id|>assistant<|end_header_id|>\n\n", false);
}

// ---------------------------------------------------------------------------------------------
// Names and detection

struct FamilyName {
  ChatFamily family;
  std::string_view name;
};
constexpr std::array<FamilyName, 7> kNames{{
    {ChatFamily::Qwen3, "qwen3"},
    {ChatFamily::Qwen3_5, "qwen3.5"},
    {ChatFamily::Qwen3_5NoThink, "qwen3.5-nothink"},
    {ChatFamily::SmolLM2, "smollm2"},
    {ChatFamily::ChatML, "chatml"},
    {ChatFamily::Llama3, "llama3"},
    {ChatFamily::Llama3_1, "llama3.1"},
}};

std::string name_list() {
  std::string s;
  for (const FamilyName& f : kNames) s += (s.empty() ? "" : ", ") + std::string(f.name);
  return s;
}

/// The template with whitespace, escaped newlines ("\n" as two characters) and Jinja's whitespace
/// control dashes removed, so that formatting and JSON/GGUF escaping do not matter to fingerprints.
std::string normalize(std::string_view t) {
  std::string s;
  s.reserve(t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    if (c == '\\' && i + 1 < t.size() && t[i + 1] == 'n') {
      ++i;
      continue;
    }
    s += c;
  }
  for (std::string_view dash : {"{%-", "-%}", "{{-", "-}}"}) {
    const std::string plain = dash.front() == '-' ? std::string(dash.substr(1)) : std::string(dash.substr(0, 2));
    for (size_t p; (p = s.find(dash)) != std::string::npos;) s.replace(p, dash.size(), plain);
  }
  return s;
}

/// True when the normalized template holds every snippet (snippets are normalized too).
bool has_all(const std::string& norm, std::initializer_list<std::string_view> snippets) {
  for (std::string_view s : snippets)
    if (!contains(norm, normalize(s))) return false;
  return true;
}

/// Qwen3.5 / Qwen3.6 / Qwen3.5-0.8B: the shared body, then the think-block condition and the
/// generation prompt's default tell them apart (other variants are not recognized).
std::optional<ChatFamily> detect_qwen3_5(const std::string& n) {
  if (!has_all(n, {"<|im_start|>", "render_content(", "message.reasoning_content is string", "reasoning_content|trim",
                   "'<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content",
                   "raise_exception('No user query found in messages.')",
                   "raise_exception('System message must be at the beginning.')"}))
    return std::nullopt;
  const bool plain_condition = has_all(n, {"{% if loop.index0 > ns.last_query_index %}"}) ||
                               has_all(n, {"{% if (preserve_thinking is defined and preserve_thinking is true) or "
                                           "(loop.index0 > ns.last_query_index) %}"});
  if (!plain_condition) return std::nullopt;
  if (has_all(n, {"{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
                  "{% else %}{{ '<think>\n' }}"}))
    return ChatFamily::Qwen3_5;
  if (has_all(n, {"{% if enable_thinking is defined and enable_thinking is true %}{{ '<think>\n' }}"
                  "{% else %}{{ '<think>\n\n</think>\n\n' }}"}))
    return ChatFamily::Qwen3_5NoThink;
  return std::nullopt;
}

bool is_qwen3(const std::string& n) {
  return has_all(n, {"<|im_start|>", "message.reasoning_content is defined and message.reasoning_content is not none",
                     "'\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n')",
                     "loop.last or (not loop.last and reasoning_content)",
                     "{% if enable_thinking is defined and enable_thinking is false %}"
                     "{{ '<think>\n\n</think>\n\n' }}"}) &&
         !contains(n, "render_content") && !contains(n, "preserve_thinking");
}

bool is_smollm2(const std::string& n) {
  return has_all(n, {"loop.first and messages[0]['role'] != 'system'",
                     "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                     "trained by Hugging Face<|im_end|>\n'",
                     "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'"});
}

bool is_llama3_1(const std::string& n) {
  return has_all(n, {"bos_token", "messages[0]['content']|trim", "\"<|start_header_id|>system<|end_header_id|>\n\n\"",
                     "\"Cutting Knowledge Date: December 2023\n\"", "\"Today Date: \" + date_string + \"\n\n\"",
                     "set date_string = \"26 Jul 2024\"",
                     "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                     "'<|eot_id|>'"});
}

bool is_llama3(const std::string& n) {
  return has_all(n, {"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                     "'<|eot_id|>'",
                     "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}",
                     "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"}) &&
         !contains(n, "Cutting");
}

/// Plain ChatML: the turn expression and nothing that could change the text of valid conversations
/// (default system prompts, trimming, think blocks, tools, BOS...).
bool is_chatml(std::string_view raw, const std::string& n) {
  const bool turn = has_all(n, {"'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"}) ||
                    has_all(n, {"'<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>'"});
  if (!turn) return false;
  for (std::string_view word : {"tool", "think", "reasoning", "system_message", "messages[0]", "loop.first",
                                "loop.last", "You are", "trim", "strip", "bos_token", "eos_token", "namespace",
                                "macro", "date", "image", "[1:]"})
    if (contains(raw, word)) return false;
  return true;
}

}  // namespace

ChatFamily detect_chat_family(const std::string& chat_template) {
  const std::string n = normalize(chat_template);
  if (const auto q = detect_qwen3_5(n)) return *q;
  if (is_qwen3(n)) return ChatFamily::Qwen3;
  if (is_smollm2(n)) return ChatFamily::SmolLM2;
  if (is_llama3_1(n)) return ChatFamily::Llama3_1;
  if (is_llama3(n)) return ChatFamily::Llama3;
  if (is_chatml(chat_template, n)) return ChatFamily::ChatML;
  throw std::runtime_error("unrecognized chat template (known families: " + name_list() +
                           "); if the model uses one of them, pass --chat-template NAME");
}

ChatFamily chat_family_from_name(const std::string& name) {
  if (name == "qwen3.6") return ChatFamily::Qwen3_5;
  for (const FamilyName& f : kNames)
    if (f.name == name) return f.family;
  throw std::invalid_argument("unknown chat template '" + name + "' (known: " + name_list() + ")");
}

std::string chat_family_name(ChatFamily f) {
  for (const FamilyName& n : kNames)
    if (n.family == f) return std::string(n.name);
  throw std::invalid_argument("chat_family_name: bad ChatFamily value");
}

std::string_view end_of_turn_token(ChatFamily f) {
  return f == ChatFamily::Llama3 || f == ChatFamily::Llama3_1 ? kEot : kImEnd;
}

std::vector<ChatSegment> render_chat(ChatFamily family, const std::vector<ChatMessage>& messages,
                                     const ChatOptions& opt) {
  check_messages(messages);
  Segments out;
  switch (family) {
    case ChatFamily::Qwen3: render_qwen3(out, messages, opt); break;
    case ChatFamily::Qwen3_5: render_qwen3_5(out, messages, opt, true); break;
    case ChatFamily::Qwen3_5NoThink: render_qwen3_5(out, messages, opt, false); break;
    case ChatFamily::SmolLM2: render_chatml(out, messages, opt, true); break;
    case ChatFamily::ChatML: render_chatml(out, messages, opt, false); break;
    case ChatFamily::Llama3: render_llama3(out, messages, opt, false); break;
    case ChatFamily::Llama3_1: render_llama3(out, messages, opt, true); break;
    default: throw std::invalid_argument("render_chat: bad ChatFamily value");
  }
  return out.take();
}

std::string render_chat_text(ChatFamily family, const std::vector<ChatMessage>& messages, const ChatOptions& opt) {
  std::string text;
  for (const ChatSegment& s : render_chat(family, messages, opt)) text += s.text;
  return text;
}

}  // namespace dflash
