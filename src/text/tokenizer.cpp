// The byte-level BPE Tokenizer: tokenizers' encode pipeline (added tokens, normalizer,
// pre-tokenizer splits, byte-level BPE, post-processor) and decode (added tokens between decoded
// chunks of model tokens).
#include "text/tokenizer.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <unordered_map>

#include "io/gguf.h"
#include "text/bpe.h"
#include "text/tokenizer_added.h"
#include "text/tokenizer_regex.h"
#include "text/tokenizer_spec.h"
#include "text/tokenizer_unicode.h"

namespace dflash {

namespace text {

namespace {

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(TokenizerSpec spec);

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 8);
    encode_impl<false>(text, add_special_tokens, &ids, nullptr);
    return ids;
  }
  std::vector<TokenSpan> encode_with_offsets(std::string_view text, bool add_special_tokens) const override {
    std::vector<TokenSpan> spans;
    spans.reserve(text.size() / 3 + 8);
    encode_impl<true>(text, add_special_tokens, nullptr, &spans);
    if (trim_offsets_) trim(spans);
    return spans;
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const override;

  std::optional<int32_t> token_to_id(std::string_view token) const override {
    if (auto it = added_ids_.find(token); it != added_ids_.end()) return it->second;
    if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
    return std::nullopt;
  }
  std::string id_to_token(int32_t id) const override {
    check_id(id, "id_to_token");
    return tokens_[std::size_t(id)];
  }
  int64_t vocab_size() const override { return int64_t(tokens_.size()); }
  bool is_special(int32_t id) const override {
    return id >= 0 && std::size_t(id) < kind_.size() && kind_[std::size_t(id)] == kAddedSpecial;
  }
  const std::string& chat_template() const override { return chat_template_; }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }

 private:
  enum Kind : uint8_t { kNone, kModel, kAdded, kAddedSpecial };

  template <bool kOffsets>
  void encode_impl(std::string_view text, bool add_special, std::vector<int32_t>* ids, std::vector<TokenSpan>* spans) const;
  template <bool kOffsets>
  void encode_gap(std::string_view gap, uint32_t base, std::vector<int32_t>* ids, std::vector<TokenSpan>* spans,
                  std::vector<BpePiece>& pieces) const;
  template <class Emit>
  void split(std::size_t level, const char* s, std::size_t b, std::size_t e, bool exact, Emit& emit) const;
  void trim(std::vector<TokenSpan>& spans) const;
  void decode_chunk(const std::vector<int32_t>& chunk, std::string& out) const;
  void check_id(int32_t id, const char* what) const {
    if (id < 0 || std::size_t(id) >= kind_.size() || kind_[std::size_t(id)] == kNone)
      throw std::out_of_range(fmt::format("{}: token id {} is not in the vocabulary (size {})", what, id, kind_.size()));
  }

  std::string origin_;
  std::vector<std::string> tokens_;  // id -> token string (added tokens: their content)
  std::vector<uint8_t> kind_;        // id -> Kind
  TokenMap vocab_, added_ids_;
  std::unique_ptr<BpeModel> bpe_;
  bool nfc_ = false;
  std::vector<std::unique_ptr<SplitRegex>> splits_;
  AddedTokenMatcher raw_added_, normalized_added_;
  std::vector<int32_t> prefix_, suffix_;
  bool trim_offsets_ = false, post_add_prefix_space_ = false;
  std::vector<uint32_t> lead_ws_, trail_ws_;  // trim_offsets: whitespace bytes at a token's ends
  std::vector<DecoderStep> decoder_;
  bool plain_byte_level_ = false;  // decoder is exactly [ByteLevel]: decode from token_bytes_
  std::string token_bytes_;
  std::vector<uint32_t> token_offset_;
  std::string chat_template_;
  std::optional<int32_t> bos_, eos_;
};

BpeTokenizer::BpeTokenizer(TokenizerSpec spec) : origin_(spec.origin) {
  auto fail = [&](const std::string& what) -> void { throw std::runtime_error(origin_ + ": " + what); };
  const ByteLevelAlphabet& alpha = byte_level_alphabet();

  // Vocabulary.
  // Ids index dense tables: a hostile id must not make them huge.
  constexpr int32_t kMaxId = (1 << 24) - 1;
  int32_t max_id = -1;
  for (const auto& [tok, id] : spec.vocab) max_id = std::max(max_id, id);
  for (const auto& a : spec.added) max_id = std::max(max_id, a.id);
  if (max_id > kMaxId) fail(fmt::format("token id {} is too large (at most {} is supported)", max_id, kMaxId));
  vocab_.reserve(spec.vocab.size());
  std::vector<const std::string*> model_token(std::size_t(max_id + 1), nullptr);
  for (const auto& [tok, id] : spec.vocab) {
    if (utf8_invalid_offset(tok) != tok.size()) fail(fmt::format("vocabulary token {} is not valid UTF-8", id));
    if (model_token[std::size_t(id)]) fail(fmt::format("id {} is given to two tokens ('{}' and '{}')", id, *model_token[std::size_t(id)], tok));
    model_token[std::size_t(id)] = &tok;
    vocab_[tok] = id;  // a repeated token keeps its last id
  }
  for (auto& a : spec.added) {
    if (a.id < 0) {  // resolve by content (GGUF): the vocabulary id; a token outside it is an error
      if (auto it = vocab_.find(a.content); it != vocab_.end())
        a.id = it->second;
      else
        fail("added token '" + a.content + "' is not in the vocabulary");
    }
    max_id = std::max(max_id, a.id);
  }
  tokens_.assign(std::size_t(max_id + 1), std::string());
  kind_.assign(std::size_t(max_id + 1), kNone);
  for (std::size_t id = 0; id < model_token.size(); ++id)
    if (model_token[id]) {
      tokens_[id] = *model_token[id];
      kind_[id] = kModel;
    }
  for (auto& a : spec.added) {
    if (utf8_invalid_offset(a.content) != a.content.size()) fail("added token " + std::to_string(a.id) + " is not valid UTF-8");
    const std::size_t id = std::size_t(a.id);
    if (kind_[id] == kModel && tokens_[id] != a.content)
      fail(fmt::format("added token '{}' has id {}, which the vocabulary gives to '{}'", a.content, a.id, tokens_[id]));
    if (kind_[id] >= kAdded && tokens_[id] != a.content)
      fail(fmt::format("added tokens '{}' and '{}' share id {}", tokens_[id], a.content, a.id));
    tokens_[id] = a.content;
    kind_[id] = a.special ? kAddedSpecial : kAdded;
    added_ids_[a.content] = a.id;
    if (a.normalized && spec.nfc) {
      std::string n;
      normalized_added_.add(nfc(a.content, n) ? n : a.content, a.id);
    } else if (a.normalized) {
      normalized_added_.add(a.content, a.id);
    } else {
      raw_added_.add(a.content, a.id);
    }
  }

  // BPE model.
  BpeModel::Options opt;
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(alpha.byte_char[b]);
    opt.byte_ids[std::size_t(b)] = it == vocab_.end() ? -1 : it->second;
    opt.fallback_count[std::size_t(b)] = 0;
    const std::string& ch = alpha.byte_char[b];
    bool all = true;
    for (std::size_t k = 0; k < ch.size(); ++k) {
      auto f = vocab_.find(fmt::format("<0x{:02X}>", static_cast<unsigned char>(ch[k])));
      if (f == vocab_.end()) {
        all = false;
        break;
      }
      opt.fallback_ids[std::size_t(b)][k] = f->second;
    }
    if (all) opt.fallback_count[std::size_t(b)] = uint8_t(ch.size());
  }
  if (spec.unk_token) {
    auto it = vocab_.find(*spec.unk_token);
    if (it == vocab_.end()) fail("unk_token '" + *spec.unk_token + "' is not in the vocabulary");
    opt.unk_id = it->second;
  }
  opt.byte_fallback = spec.byte_fallback;
  opt.fuse_unk = spec.fuse_unk;
  opt.ignore_merges = spec.ignore_merges;
  if (opt.ignore_merges) {
    std::string raw;
    for (const auto& [tok, id] : vocab_) {
      raw.clear();
      if (alpha.decode(tok, raw)) opt.whole_words[raw] = id;
    }
  }
  std::vector<BpeMerge> merges;
  merges.reserve(spec.merges.size());
  std::string joined;
  for (std::size_t r = 0; r < spec.merges.size(); ++r) {
    const auto& [a, b] = spec.merges[r];
    auto ia = vocab_.find(a), ib = vocab_.find(b);
    if (ia == vocab_.end() || ib == vocab_.end())
      fail(fmt::format("merge {} ('{} {}') names a token that is not in the vocabulary: '{}'", r + 1, a, b,
                       ia == vocab_.end() ? a : b));
    joined = a;
    joined += b;
    auto ij = vocab_.find(joined);
    if (ij == vocab_.end()) fail(fmt::format("merge {} ('{} {}') makes '{}', which is not in the vocabulary", r + 1, a, b, joined));
    merges.push_back({ia->second, ib->second, ij->second});
  }
  bpe_ = std::make_unique<BpeModel>(std::move(opt), merges);

  // Pipeline.
  nfc_ = spec.nfc;
  for (const auto& s : spec.splits) {
    try {
      splits_.push_back(std::make_unique<SplitRegex>(s.pattern, s.literal));
    } catch (const std::invalid_argument& e) {
      fail(std::string("pre_tokenizer Split: ") + e.what());
    }
  }
  for (const auto* v : {&spec.prefix_ids, &spec.suffix_ids})
    for (int32_t id : *v)
      if (id < 0 || std::size_t(id) >= kind_.size() || kind_[std::size_t(id)] == kNone)
        fail(fmt::format("post_processor adds token id {}, which is not in the vocabulary", id));
  prefix_ = spec.prefix_ids;
  suffix_ = spec.suffix_ids;
  trim_offsets_ = spec.trim_offsets;
  post_add_prefix_space_ = spec.post_add_prefix_space;
  if (trim_offsets_) {
    lead_ws_.assign(tokens_.size(), 0);
    trail_ws_.assign(tokens_.size(), 0);
    for (std::size_t id = 0; id < tokens_.size(); ++id) {
      std::vector<std::pair<char32_t, std::size_t>> cs;  // (char, bytes it stands for in the input)
      const std::string& t = tokens_[id];
      for (std::size_t i = 0; i < t.size();) {
        const std::size_t b = i;
        const char32_t c = next_utf8(t, i);
        cs.emplace_back(c, kind_[id] == kModel ? 1 : i - b);
      }
      auto space = [](char32_t c) { return c == 0x120 || is_white_space(c); };
      std::size_t k = 0;
      for (; k < cs.size() && space(cs[k].first); ++k) lead_ws_[id] += uint32_t(cs[k].second);
      for (std::size_t j = cs.size(); j > k && space(cs[j - 1].first); --j) trail_ws_[id] += uint32_t(cs[j - 1].second);
    }
  }
  decoder_ = std::move(spec.decoder);
  plain_byte_level_ = decoder_.size() == 1 && decoder_[0].kind == DecoderStep::ByteLevel;
  if (plain_byte_level_) {
    token_offset_.assign(tokens_.size() + 1, 0);
    for (std::size_t id = 0; id < tokens_.size(); ++id) {
      if (kind_[id] == kModel && !alpha.decode(tokens_[id], token_bytes_)) token_bytes_ += tokens_[id];
      token_offset_[id + 1] = uint32_t(token_bytes_.size());
    }
  }

  chat_template_ = std::move(spec.chat_template);
  bos_ = spec.bos_id;
  eos_ = spec.eos_id;
  if (!bos_ && spec.bos_token) bos_ = token_to_id(*spec.bos_token);
  if (!eos_ && spec.eos_token) eos_ = token_to_id(*spec.eos_token);
}

template <class Emit>
void BpeTokenizer::split(std::size_t level, const char* s, std::size_t b, std::size_t e, bool exact, Emit& emit) const {
  if (level == splits_.size()) {
    emit(b, e);
    return;
  }
  const SplitRegex& re = *splits_[level];
  std::size_t pos = b, mb, me;
  // The regex sees the piece alone, as tokenizers applies it to each piece's own string.
  while (pos < e && re.find(s + b, e - b, pos - b, &mb, &me, exact)) {
    mb += b;
    me += b;
    if (mb > pos) split(level + 1, s, pos, mb, exact, emit);
    split(level + 1, s, mb, me, exact, emit);
    pos = me;
  }
  if (pos < e) split(level + 1, s, pos, e, exact, emit);
}

template <bool kOffsets>
void BpeTokenizer::encode_gap(std::string_view gap, uint32_t base, std::vector<int32_t>* ids,
                              std::vector<TokenSpan>* spans, std::vector<BpePiece>& pieces) const {
  std::string normalized_storage;
  std::string_view norm = gap;
  bool changed = false;
  ByteAlignment align;
  if (nfc_ && nfc(gap, normalized_storage)) {
    norm = normalized_storage;
    changed = true;
    if constexpr (kOffsets) align = nfc_alignment(gap, norm, base);
  }
  // Input byte range of normalized bytes [nb, ne): whole characters, mapped back through NFC.
  auto span_of = [&](std::size_t nb, std::size_t ne) -> std::pair<uint32_t, uint32_t> {
    if (ne <= nb) {  // a zero-length piece (second byte-fallback token of a character)
      if (nb == 0) return {base, base};
      nb = nb - 1;
      ne = nb + 1;
    }
    if (changed) return {align.begin[nb], align.end[ne - 1]};
    while (nb > 0 && (static_cast<unsigned char>(norm[nb]) & 0xC0) == 0x80) --nb;
    while (ne < norm.size() && (static_cast<unsigned char>(norm[ne]) & 0xC0) == 0x80) ++ne;
    return {base + uint32_t(nb), base + uint32_t(ne)};
  };
  BpeWordCache& cache = bpe_->thread_cache();
  auto emit = [&](std::size_t b, std::size_t e) {
    pieces.clear();
    bpe_->encode_word(norm.substr(b, e - b), pieces, cache);
    if constexpr (kOffsets) {
      std::size_t pos = b;
      for (const BpePiece& p : pieces) {
        const auto [ob, oe] = span_of(pos, pos + p.len);
        spans->push_back({p.id, ob, oe});
        pos += p.len;
      }
    } else {
      for (const BpePiece& p : pieces) ids->push_back(p.id);
    }
  };
  // PCRE2's exact (Oniguruma-compatible) programs are slower; only text with a code point where
  // the Unicode tables differ needs them.
  const bool exact = !splits_.empty() && has_onig_divergent_chars(norm);
  std::size_t pos = 0;
  AddedTokenMatcher::Match m;
  while (normalized_added_.find(norm, pos, &m)) {
    if (m.begin > pos) split(0, norm.data(), pos, m.begin, exact, emit);
    if constexpr (kOffsets) {
      const auto [ob, oe] = span_of(m.begin, m.end);
      spans->push_back({m.id, ob, oe});
    } else {
      ids->push_back(m.id);
    }
    pos = m.end;
  }
  if (pos < norm.size()) split(0, norm.data(), pos, norm.size(), exact, emit);
}

template <bool kOffsets>
void BpeTokenizer::encode_impl(std::string_view text, bool add_special, std::vector<int32_t>* ids,
                               std::vector<TokenSpan>* spans) const {
  if (const std::size_t bad = utf8_invalid_offset(text); bad != text.size())
    throw std::invalid_argument(fmt::format("tokenizer encode: the text is not valid UTF-8 (at byte {})", bad));
  if (text.size() >= UINT32_MAX) throw std::invalid_argument("tokenizer encode: text longer than 4 GiB");
  auto push = [&](int32_t id, uint32_t b, uint32_t e) {
    if constexpr (kOffsets)
      spans->push_back({id, b, e});
    else
      ids->push_back(id);
  };
  if (add_special)
    for (int32_t id : prefix_) push(id, 0, 0);
  std::vector<BpePiece> pieces;
  std::size_t pos = 0;
  AddedTokenMatcher::Match m;
  while (raw_added_.find(text, pos, &m)) {
    if (m.begin > pos) encode_gap<kOffsets>(text.substr(pos, m.begin - pos), uint32_t(pos), ids, spans, pieces);
    push(m.id, uint32_t(m.begin), uint32_t(m.end));
    pos = m.end;
  }
  if (pos < text.size()) encode_gap<kOffsets>(text.substr(pos), uint32_t(pos), ids, spans, pieces);
  if (add_special)
    for (int32_t id : suffix_) push(id, 0, 0);
}

// tokenizers' ByteLevel post-processor with trim_offsets: leading / trailing spaces of a token are
// left out of its offsets (a single leading space of the first token is kept with add_prefix_space).
void BpeTokenizer::trim(std::vector<TokenSpan>& spans) const {
  for (std::size_t i = 0; i < spans.size(); ++i) {
    TokenSpan& s = spans[i];
    uint32_t lead = lead_ws_[std::size_t(s.id)];
    const uint32_t trail = trail_ws_[std::size_t(s.id)];
    if (lead > 0) {
      const bool first = i == 0 || s.begin == 0;
      if (first && post_add_prefix_space_ && lead == 1) lead = 0;
      s.begin = std::min(s.begin + lead, s.end);
    }
    if (trail > 0 && s.end >= trail) s.end = std::max(s.end - trail, s.begin);
  }
}

void BpeTokenizer::decode_chunk(const std::vector<int32_t>& chunk, std::string& out) const {
  if (chunk.empty()) return;
  if (plain_byte_level_) {
    std::string bytes;
    for (int32_t id : chunk)
      bytes.append(token_bytes_, token_offset_[std::size_t(id)], token_offset_[std::size_t(id) + 1] - token_offset_[std::size_t(id)]);
    append_utf8_lossy(bytes, out);
    return;
  }
  std::vector<std::string> toks;
  toks.reserve(chunk.size());
  for (int32_t id : chunk) toks.push_back(tokens_[std::size_t(id)]);
  run_decoder(decoder_, std::move(toks), out);
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string out;
  std::vector<int32_t> chunk;
  for (int32_t id : ids) {
    check_id(id, "decode");
    const uint8_t k = kind_[std::size_t(id)];
    if (k == kModel) {
      chunk.push_back(id);
      continue;
    }
    if (k == kAddedSpecial && skip_special_tokens) continue;
    decode_chunk(chunk, out);
    chunk.clear();
    out += tokens_[std::size_t(id)];
  }
  decode_chunk(chunk, out);
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> make_tokenizer(TokenizerSpec spec) { return std::make_unique<BpeTokenizer>(std::move(spec)); }

}  // namespace text

std::unique_ptr<Tokenizer> Tokenizer::from_tokenizer_json(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string config = (p.parent_path() / "tokenizer_config.json").string();
  return text::make_tokenizer(text::parse_tokenizer_json(path, config));
}

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GGUFFile& gguf) {
  return text::make_tokenizer(text::spec_from_gguf(gguf));
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path j = fs::path(path) / "tokenizer.json";
    if (!fs::is_regular_file(j, ec)) throw std::runtime_error(path + ": directory has no tokenizer.json");
    return from_tokenizer_json(j.string());
  }
  char magic[4] = {};
  {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error(path + ": cannot open tokenizer");
    f.read(magic, 4);
  }
  if (std::memcmp(magic, "GGUF", 4) == 0) {
    const GGUFFile gguf(path);
    return from_gguf(gguf);
  }
  return from_tokenizer_json(path);
}

}  // namespace dflash
