// tokenizers' decoder chain over token strings (ByteFallback, Fuse, Replace, ByteLevel, Strip).
#include <cctype>
#include <string>
#include <vector>

#include "text/tokenizer_spec.h"
#include "text/tokenizer_unicode.h"

namespace dflash::text {

namespace {

// "<0xAB>" -> 0xAB, or -1.
int byte_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  if (!std::isxdigit(static_cast<unsigned char>(t[3])) || !std::isxdigit(static_cast<unsigned char>(t[4]))) return -1;
  return std::stoi(t.substr(3, 2), nullptr, 16);
}

// Consecutive byte tokens become their text when it is valid UTF-8, else one U+FFFD per byte.
std::vector<std::string> byte_fallback(std::vector<std::string> toks) {
  std::vector<std::string> out;
  std::string bytes;
  std::size_t n_bytes = 0;
  auto flush = [&] {
    if (n_bytes == 0) return;
    if (utf8_invalid_offset(bytes) == bytes.size())
      out.push_back(bytes);
    else
      for (std::size_t k = 0; k < n_bytes; ++k) out.emplace_back("\xEF\xBF\xBD");
    bytes.clear();
    n_bytes = 0;
  };
  for (auto& t : toks) {
    const int b = byte_token(t);
    if (b >= 0) {
      bytes += char(b);
      ++n_bytes;
    } else {
      flush();
      out.push_back(std::move(t));
    }
  }
  flush();
  return out;
}

std::string replace_all(const std::string& t, const std::string& pattern, const std::string& content) {
  std::string r;
  std::size_t p = 0, q;
  while ((q = t.find(pattern, p)) != std::string::npos) {
    r.append(t, p, q - p);
    r += content;
    p = q + pattern.size();
  }
  r.append(t, p, std::string::npos);
  return r;
}

// Up to `start` leading and `stop` trailing copies of `c` removed.
std::string strip(const std::string& t, const std::string& c, int start, int stop) {
  std::size_t b = 0, e = t.size();
  if (c.empty()) return t;
  for (int k = 0; k < start && b + c.size() <= e && t.compare(b, c.size(), c) == 0; ++k) b += c.size();
  for (int k = 0; k < stop && e >= b + c.size() && t.compare(e - c.size(), c.size(), c) == 0; ++k) e -= c.size();
  return t.substr(b, e - b);
}

}  // namespace

void run_decoder(const std::vector<DecoderStep>& steps, std::vector<std::string> toks, std::string& out) {
  const ByteLevelAlphabet& alpha = byte_level_alphabet();
  for (const DecoderStep& d : steps) {
    switch (d.kind) {
      case DecoderStep::ByteFallback:
        toks = byte_fallback(std::move(toks));
        break;
      case DecoderStep::Fuse: {
        std::string all;
        for (const auto& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecoderStep::Replace:
        for (auto& t : toks) t = replace_all(t, d.pattern, d.content);
        break;
      case DecoderStep::ByteLevel: {  // a token with a character outside the alphabet stays as it is
        std::string bytes;
        for (const auto& t : toks)
          if (!alpha.decode(t, bytes)) bytes += t;
        std::string s;
        append_utf8_lossy(bytes, s);
        toks.assign(1, std::move(s));
        break;
      }
      case DecoderStep::Strip:
        for (auto& t : toks) t = strip(t, d.content, d.start, d.stop);
        break;
    }
  }
  for (const auto& t : toks) out += t;
}

}  // namespace dflash::text
