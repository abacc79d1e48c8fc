// What a byte-level BPE tokenizer is made of, independent of where it was read from (internal):
// tokenizer.json and GGUF metadata are both turned into a TokenizerSpec, and make_tokenizer builds
// the Tokenizer from it.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "text/tokenizer.h"  // also declares dflash::GGUFFile

namespace dflash::text {

/// An entry of tokenizers' AddedVocabulary. lstrip / rstrip / single_word are not supported (the
/// loaders reject them).
struct AddedTokenSpec {
  std::string content;
  int32_t id = 0;
  bool special = false;
  /// Matched in the normalized text (true) or in the raw input (false).
  bool normalized = false;
};

/// One pre-tokenizer regex split (tokenizers' Split with behavior Isolated, invert false: matches
/// and the gaps between them both become pieces).
struct SplitSpec {
  std::string pattern;
  bool literal = false;
};

/// One step of the decoder chain (tokenizers' decoders).
struct DecoderStep {
  enum Kind { ByteFallback, Fuse, Replace, ByteLevel, Strip } kind = ByteLevel;
  std::string pattern, content;  // Replace: literal pattern -> content; Strip: content (one char)
  int start = 0, stop = 0;       // Strip
};

struct TokenizerSpec {
  /// Where it came from ("tokenizer.json /path" or "GGUF /path"), for error messages.
  std::string origin;

  // BPE model.
  std::vector<std::pair<std::string, int32_t>> vocab;        // token -> id; a later entry wins
  std::vector<std::pair<std::string, std::string>> merges;   // in rank order
  std::optional<std::string> unk_token;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;

  // Pipeline.
  bool nfc = false;
  std::vector<SplitSpec> splits;  // applied in order, then the byte-level mapping
  std::vector<AddedTokenSpec> added;
  std::vector<int32_t> prefix_ids, suffix_ids;  // post-processor (single sequence), add_special_tokens
  bool trim_offsets = false;                    // ByteLevel post-processor trim_offsets...
  bool post_add_prefix_space = false;           // ...and its add_prefix_space (kept on a first token)
  std::vector<DecoderStep> decoder;

  // Metadata.
  std::string chat_template;
  std::optional<int32_t> bos_id, eos_id;
  std::optional<std::string> bos_token, eos_token;  // resolved to ids by make_tokenizer
};

/// Parses a tokenizer.json (and, when `config_path` is non-empty and exists, its
/// tokenizer_config.json for chat template and BOS/EOS). Throws std::runtime_error naming the file
/// and the unsupported or malformed component.
TokenizerSpec parse_tokenizer_json(const std::string& path, const std::string& config_path);

/// What transformers' GGUF conversion (GGUFLlamaConverter, llama architecture, tokenizer.ggml.model
/// "gpt2") builds from the file's tokenizer.ggml.* metadata. Throws std::runtime_error naming the
/// file for other architectures / tokenizer models and for missing or ill-typed keys.
TokenizerSpec spec_from_gguf(const GGUFFile& gguf);

/// Appends the text of `toks` (the token strings of consecutive model tokens) after the decoder
/// chain `steps`, as tokenizers' Decoder::decode does: ByteFallback ("<0xAB>" tokens to bytes), Fuse
/// (join), Replace (literal), ByteLevel (characters to bytes, lossy UTF-8), Strip.
void run_decoder(const std::vector<DecoderStep>& steps, std::vector<std::string> toks, std::string& out);

/// Builds the Tokenizer. Throws std::runtime_error (prefixed by spec.origin) for inconsistent data:
/// merges naming unknown tokens, a merge result missing from the vocabulary, duplicate or negative
/// ids, an unknown unk_token, regexes that do not compile...
std::unique_ptr<Tokenizer> make_tokenizer(TokenizerSpec spec);

}  // namespace dflash::text
