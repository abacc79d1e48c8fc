// Byte-level BPE tokenizer with exactly the ids of Hugging Face `tokenizers` (tokenizer.json) and
// of transformers' conversion of GGUF `tokenizer.ggml.*` metadata (gpt2 type).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dflash {

class GGUFFile;

/// One token of an encoding: its id and the byte range [begin, end) of the input text it came from
/// (for a token made of part of a multi-byte character both halves cover the whole character;
/// where NFC changed the text, a token covers all the input characters its normalized characters
/// came from, e.g. both "e" and U+0301 for "é"; tokens added by the post-processor have [0, 0)).
struct TokenSpan {
  int32_t id;
  uint32_t begin, end;
};

/// A loaded tokenizer. Immutable after load: encode/decode are safe from many threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// MODEL is a tokenizer.json, a directory holding one (tokenizer_config.json beside it supplies
  /// the chat template and special-token names), or a .gguf file. Throws std::runtime_error naming
  /// the file and what is wrong (unsupported model type, pre-tokenizer, bad merges...).
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  static std::unique_ptr<Tokenizer> from_tokenizer_json(const std::string& path);
  static std::unique_ptr<Tokenizer> from_gguf(const GGUFFile& gguf);

  /// Token ids of `text` as tokenizers' `encode(text, add_special_tokens=add_special_tokens)`:
  /// added/special tokens inside the text are matched first, the rest is normalized (NFC where the
  /// tokenizer says so), split by the pre-tokenizer regex, byte-level mapped and BPE-merged.
  /// Throws std::invalid_argument when `text` is not valid UTF-8 (naming the byte offset).
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const = 0;
  /// Same with each token's byte range in `text`.
  virtual std::vector<TokenSpan> encode_with_offsets(std::string_view text, bool add_special_tokens = false) const = 0;
  /// Text of `ids` as tokenizers' decode (byte-level decoder; incomplete UTF-8 becomes U+FFFD);
  /// decode(encode(s)) == s for valid UTF-8 s (NFC(s) when the tokenizer normalizes with NFC; a
  /// byte without a token, like some control characters for SmolLM2, comes back as the unk token).
  /// Throws std::out_of_range for ids outside the vocabulary.
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const = 0;

  /// Id of a token string (vocabulary or added token), or nullopt.
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  /// The token string of `id`; throws std::out_of_range.
  virtual std::string id_to_token(int32_t id) const = 0;
  /// Number of ids (max id + 1, added tokens included).
  virtual int64_t vocab_size() const = 0;
  virtual bool is_special(int32_t id) const = 0;

  /// The Jinja chat template shipped with the tokenizer ("" when none).
  virtual const std::string& chat_template() const = 0;
  /// BOS / EOS ids from tokenizer_config.json or GGUF metadata, when defined.
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
};

}  // namespace dflash
