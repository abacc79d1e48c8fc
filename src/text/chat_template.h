// Chat templates rendered natively (no Jinja): the families real targets ship, with output identical
// to transformers' apply_chat_template for the supported features (system, multi-turn,
// add_generation_prompt; Qwen3 <think> handling).
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dflash {

/// One chat message. role: "system", "user" or "assistant" (others are rejected with an error).
struct ChatMessage {
  std::string role;
  std::string content;
  /// Qwen3 / Qwen3.5 `reasoning_content` (the text inside <think></think>), when given separately.
  std::optional<std::string> reasoning_content;
};

/// The roles every family renders: system, user, assistant (tool turns are not supported).
inline bool is_supported_role(std::string_view r) { return r == "system" || r == "user" || r == "assistant"; }

/// Template families. Names as accepted by --chat-template.
enum class ChatFamily {
  Qwen3,           // "qwen3": ChatML with Qwen3's <think> handling
  Qwen3_5,         // "qwen3.5" (alias "qwen3.6"): Qwen3.5-9B/27B and Qwen3.6 ChatML (thinking on by default)
  SmolLM2,         // "smollm2": ChatML with SmolLM2's default system prompt
  ChatML,          // "chatml": plain ChatML
  Llama3,          // "llama3": <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|> (Llama 3.0)
  Llama3_1,        // "llama3.1": Llama 3.1/3.2/3.3, with the "Cutting Knowledge Date" system header
  Qwen3_5NoThink,  // "qwen3.5-nothink": Qwen3.5-0.8B's template (generation prompt: thinking off by default)
};

/// Recognizes the family from a model's Jinja `chat_template`; throws std::runtime_error listing the
/// known families (and suggesting --chat-template) when it is not recognized.
ChatFamily detect_chat_family(const std::string& chat_template);
/// Parses a --chat-template name; throws std::invalid_argument listing the names.
ChatFamily chat_family_from_name(const std::string& name);
std::string chat_family_name(ChatFamily f);
/// The token that ends an assistant turn in family `f` ("<|im_end|>" for the ChatML families,
/// "<|eot_id|>" for Llama 3): generation stops there.
std::string_view end_of_turn_token(ChatFamily f);

/// A rendered piece of the conversation; `assistant` marks text a drafter is trained on: an
/// assistant turn's content and its end-of-turn token (not the role header, not the newline after the
/// end token). For Qwen the content includes the <think>...</think> block the template writes.
struct ChatSegment {
  std::string text;
  bool assistant = false;
};

struct ChatOptions {
  bool add_generation_prompt = false;
  /// Qwen3: enable_thinking=false appends an empty <think></think> after the generation prompt.
  /// Qwen3.5: the generation prompt opens <think> unless thinking is off (unset: the template's default).
  /// Ignored by the other families, as their templates ignore it.
  std::optional<bool> enable_thinking;
};

/// Renders `messages` as transformers' apply_chat_template(tokenize=False) does for that family.
/// Llama 3.x text starts with <|begin_of_text|> (as the templates write it: encode without adding special
/// tokens); Llama 3.1's "Today Date" is always "26 Jul 2024" (the template's default date_string).
/// Throws std::invalid_argument for an unknown role or an empty conversation, and where the real
/// template raises (Qwen3.5: no user query, or a system message after the first).
std::vector<ChatSegment> render_chat(ChatFamily family, const std::vector<ChatMessage>& messages,
                                     const ChatOptions& opt = {});
/// The concatenated text of render_chat.
std::string render_chat_text(ChatFamily family, const std::vector<ChatMessage>& messages,
                             const ChatOptions& opt = {});

}  // namespace dflash
