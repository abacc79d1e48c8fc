// GGUF tokenizer.ggml.* metadata -> TokenizerSpec, as transformers converts it (integrations/ggml.py,
// GGUFLlamaConverter with its "llama-3" byte-level path, then TokenizersBackend.__init__):
//   model:        BPE(vocab = {tokens[i]: i} (a repeated string keeps its last index), merges split at
//                 the space, unk_token = tokens[unknown_token_id], fuse_unk, byte_fallback)
//   added tokens: every token_type == 3 (control) token as special, normalized = false; then the
//                 unk token and tokens[bos_token_id] (transformers passes that string as both BOS and
//                 EOS) when not yet added. Without token_type: unk, BOS and tokens[bos_token_id].
//   normalizer:   none;  pre-tokenizer: ByteLevel(add_prefix_space = false, use_regex = true)
//   post:         nothing added (transformers' add_bos_token stays false for GGUF files)
//   decoder:      ByteFallback, Fuse, Replace("▁", " "), ByteLevel, and Strip(" ", 1, 0) unless
//                 tokenizer.ggml.add_space_prefix is present and false.
// BOS / EOS ids are the file's tokenizer.ggml.bos_token_id / eos_token_id (what the model uses).
#include <algorithm>
#include <stdexcept>

#include "io/gguf.h"
#include "text/tokenizer_regex.h"
#include "text/tokenizer_spec.h"

namespace dflash::text {

namespace {

[[noreturn]] void fail(const GGUFFile& f, const std::string& what) {
  throw std::runtime_error(f.path() + ": GGUF tokenizer: " + what);
}

std::optional<int64_t> get_id(const GGUFFile& f, const char* key, std::size_t n_tokens) {
  const auto& md = f.metadata();
  if (!md.contains(key)) return std::nullopt;
  if (!md[key].is_number_integer()) fail(f, std::string(key) + " is not an integer");
  const int64_t v = md[key].get<int64_t>();
  if (v < 0 || uint64_t(v) >= n_tokens) fail(f, std::string(key) + " = " + std::to_string(v) + " is outside the vocabulary");
  return v;
}

}  // namespace

TokenizerSpec spec_from_gguf(const GGUFFile& f) {
  const auto& md = f.metadata();
  TokenizerSpec spec;
  spec.origin = f.path();
  const std::string arch = f.architecture();
  if (arch != "llama")
    fail(f, "architecture '" + arch + "' is not supported (supported: llama, as transformers' GGUFLlamaConverter converts it)");
  if (!md.contains("tokenizer.ggml.model") || !md["tokenizer.ggml.model"].is_string()) fail(f, "tokenizer.ggml.model is missing");
  const std::string model = md["tokenizer.ggml.model"].get<std::string>();
  if (model != "gpt2") fail(f, "tokenizer.ggml.model '" + model + "' is not supported (supported: gpt2, byte-level BPE)");
  if (!md.contains("tokenizer.ggml.tokens") || !md["tokenizer.ggml.tokens"].is_array())
    fail(f, "tokenizer.ggml.tokens is missing or not an array");
  if (!md.contains("tokenizer.ggml.merges") || !md["tokenizer.ggml.merges"].is_array())
    fail(f, "tokenizer.ggml.merges is missing or not an array (merges built from scores are not supported)");
  const auto& toks = md["tokenizer.ggml.tokens"];
  std::vector<std::string> tokens;
  tokens.reserve(toks.size());
  for (const auto& t : toks) {
    if (!t.is_string()) fail(f, "tokenizer.ggml.tokens holds a non-string");
    tokens.push_back(t.get<std::string>());
  }
  if (tokens.size() > std::size_t(INT32_MAX)) fail(f, "too many tokens");
  spec.vocab.reserve(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) spec.vocab.emplace_back(tokens[i], int32_t(i));
  std::size_t rank = 0;
  for (const auto& m : md["tokenizer.ggml.merges"]) {
    ++rank;
    if (!m.is_string()) fail(f, "tokenizer.ggml.merges holds a non-string");
    const std::string s = m.get<std::string>();
    const std::size_t sp = s.find(' ');
    if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
      fail(f, "merge " + std::to_string(rank) + " '" + s + "' is not two tokens separated by one space");
    spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
  }
  const auto unk = get_id(f, "tokenizer.ggml.unknown_token_id", tokens.size());
  const auto bos = get_id(f, "tokenizer.ggml.bos_token_id", tokens.size());
  const auto eos = get_id(f, "tokenizer.ggml.eos_token_id", tokens.size());
  if (unk) spec.unk_token = tokens[std::size_t(*unk)];
  spec.byte_fallback = true;
  spec.fuse_unk = true;

  // Added (special) tokens; their ids are resolved against the vocabulary by make_tokenizer
  // (a content already in the vocabulary keeps its vocabulary id, as tokenizers does).
  std::vector<std::string> specials;
  auto add = [&](const std::string& s) {
    if (std::find(specials.begin(), specials.end(), s) == specials.end()) specials.push_back(s);
  };
  if (md.contains("tokenizer.ggml.token_type")) {
    const auto& tt = md["tokenizer.ggml.token_type"];
    if (!tt.is_array() || tt.size() != tokens.size()) fail(f, "tokenizer.ggml.token_type is not an array as long as the tokens");
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (!tt[i].is_number_integer()) fail(f, "tokenizer.ggml.token_type holds a non-integer");
      if (tt[i].get<int64_t>() == 3) add(tokens[i]);
    }
    if (unk) add(tokens[std::size_t(*unk)]);
    if (bos) add(tokens[std::size_t(*bos)]);
  } else {
    if (unk) add(tokens[std::size_t(*unk)]);
    if (bos) add(tokens[std::size_t(*bos)]);
    if (eos && !bos) fail(f, "eos_token_id without bos_token_id (transformers' converter fails on such files)");
  }
  for (const auto& s : specials) {
    AddedTokenSpec a;
    a.content = s;
    a.id = -1;  // resolved in make_tokenizer
    a.special = true;
    a.normalized = false;
    spec.added.push_back(std::move(a));
  }

  spec.splits.push_back({kGpt2Pattern, false});
  spec.decoder = {{DecoderStep::ByteFallback, "", "", 0, 0},
                  {DecoderStep::Fuse, "", "", 0, 0},
                  {DecoderStep::Replace, "\xE2\x96\x81", " ", 0, 0},
                  {DecoderStep::ByteLevel, "", "", 0, 0}};
  bool add_prefix_space = true;
  if (md.contains("tokenizer.ggml.add_space_prefix")) {
    if (!md["tokenizer.ggml.add_space_prefix"].is_boolean()) fail(f, "tokenizer.ggml.add_space_prefix is not a boolean");
    add_prefix_space = md["tokenizer.ggml.add_space_prefix"].get<bool>();
  }
  if (add_prefix_space) spec.decoder.push_back({DecoderStep::Strip, "", " ", 1, 0});

  if (md.contains("tokenizer.chat_template") && md["tokenizer.chat_template"].is_string())
    spec.chat_template = md["tokenizer.chat_template"].get<std::string>();
  if (bos) spec.bos_id = int32_t(*bos);
  if (eos) spec.eos_id = int32_t(*eos);
  return spec;
}

}  // namespace dflash::text
