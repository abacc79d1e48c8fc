#include "text/tokenizer_unicode.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace dflash::text {

namespace {

// Length of the well-formed sequence starting at s[i], or 0 when it is ill-formed; on failure
// `subpart` is the length of the maximal ill-formed subpart there (>= 1).
std::size_t utf8_sequence(const unsigned char* s, std::size_t n, std::size_t i, std::size_t* subpart) {
  const unsigned char c = s[i];
  std::size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *subpart = 1;
    return 0;
  }
  std::size_t k = 1;
  for (; k < len && i + k < n; ++k) {
    const unsigned char b = s[i + k];
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) break;
  }
  if (k == len) return len;
  *subpart = k;
  return 0;
}

}  // namespace

std::size_t utf8_invalid_offset(std::string_view sv) {
  const auto* s = reinterpret_cast<const unsigned char*>(sv.data());
  const std::size_t n = sv.size();
  std::size_t i = 0;
  while (i < n) {
    if (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    std::size_t sub = 0;
    const std::size_t len = utf8_sequence(s, n, i, &sub);
    if (len == 0) return i;
    i += len;
  }
  return n;
}

void append_utf8_lossy(std::string_view bytes, std::string& out) {
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::size_t n = bytes.size();
  std::size_t i = 0, run = 0;  // [run, i) is valid and not yet copied
  while (i < n) {
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    std::size_t sub = 0;
    const std::size_t len = utf8_sequence(s, n, i, &sub);
    if (len) {
      i += len;
      continue;
    }
    out.append(bytes.data() + run, i - run);
    out += "\xEF\xBF\xBD";
    i += sub;
    run = i;
  }
  out.append(bytes.data() + run, n - run);
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

char32_t next_utf8(std::string_view sv, std::size_t& i) {
  const auto* s = reinterpret_cast<const unsigned char*>(sv.data());
  const unsigned char c = s[i];
  if (c < 0x80) {
    ++i;
    return c;
  }
  if (c < 0xE0) {
    const char32_t cp = (char32_t(c & 0x1F) << 6) | (s[i + 1] & 0x3F);
    i += 2;
    return cp;
  }
  if (c < 0xF0) {
    const char32_t cp = (char32_t(c & 0x0F) << 12) | (char32_t(s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
    i += 3;
    return cp;
  }
  const char32_t cp = (char32_t(c & 0x07) << 18) | (char32_t(s[i + 1] & 0x3F) << 12) |
                      (char32_t(s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
  i += 4;
  return cp;
}

namespace {

// Code points that utf8proc (Unicode 13) normalizes but tokenizers' NFC does not: its
// unicode-normalization-alignments tables are Unicode 9.0, so these later marks (non-zero
// combining class) and U+11930 (second half of the composition U+11938) are plain, non-composing
// starters there. Found by probing tokenizers 0.23 on every code point. Also U+11A7 (the Hangul
// T base, not a trailing consonant), which utf8proc 2.6 wrongly absorbs into a preceding LV syllable.
constexpr char32_t kNfcUnknown[][2] = {
    {0x7FD, 0x7FD},     {0x898, 0x89F},     {0x8CA, 0x8D3},     {0x9FE, 0x9FE},     {0xC3C, 0xC3C},
    {0xD3B, 0xD3C},     {0xEBA, 0xEBA},     {0x11A7, 0x11A7},   {0x1715, 0x1715},   {0x1ABF, 0x1ACE},   {0x1DF6, 0x1DFA},
    {0xA82C, 0xA82C},   {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10F46, 0x10F50}, {0x10F82, 0x10F85},
    {0x11070, 0x11070}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E}, {0x11839, 0x1183A}, {0x11930, 0x11930},
    {0x1193D, 0x1193E}, {0x11943, 0x11943}, {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47},
    {0x11A99, 0x11A99}, {0x11D42, 0x11D42}, {0x11D44, 0x11D45}, {0x11D97, 0x11D97}, {0x16FF0, 0x16FF1},
    {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF},
};

bool nfc_unknown(char32_t c) {
  for (const auto& r : kNfcUnknown) {  // sorted
    if (c < r[0]) return false;
    if (c <= r[1]) return true;
  }
  return false;
}

int combining_class(char32_t c) { return utf8proc_get_property(utf8proc_int32_t(c))->combining_class; }

// s fully decomposed and canonically ordered (each run of non-starters stably sorted by combining
// class). utf8proc orders marks with a bubble sort, quadratic on a long run of unsorted marks;
// given this it only checks the order.
std::string decompose_and_order(std::string_view s) {
  std::vector<utf8proc_int32_t> cps;
  cps.reserve(s.size());
  utf8proc_int32_t buf[32];
  for (std::size_t i = 0; i < s.size();) {
    int boundclass = 0;
    const utf8proc_ssize_t n = utf8proc_decompose_char(utf8proc_int32_t(next_utf8(s, i)), buf, 32, UTF8PROC_DECOMPOSE, &boundclass);
    if (n < 0 || n > 32) throw std::runtime_error(std::string("NFC normalization failed: ") + utf8proc_errmsg(n < 0 ? n : UTF8PROC_ERROR_OVERFLOW));
    cps.insert(cps.end(), buf, buf + n);
  }
  for (std::size_t i = 0; i < cps.size();) {
    if (combining_class(char32_t(cps[i])) == 0) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < cps.size() && combining_class(char32_t(cps[j])) != 0) ++j;
    std::stable_sort(cps.begin() + std::ptrdiff_t(i), cps.begin() + std::ptrdiff_t(j),
                     [](utf8proc_int32_t a, utf8proc_int32_t b) { return combining_class(char32_t(a)) < combining_class(char32_t(b)); });
    i = j;
  }
  std::string out;
  out.reserve(s.size());
  for (utf8proc_int32_t c : cps) append_utf8(char32_t(c), out);
  return out;
}

// utf8proc's NFC of s, appended to out (`presort`: s has a long run of marks).
void utf8proc_nfc(std::string_view s, std::string& out, bool presort) {
  if (s.empty()) return;
  std::string ordered;
  if (presort) {
    ordered = decompose_and_order(s);
    s = ordered;
  }
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()), &dst,
                                          utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> hold(dst, &std::free);
  if (n < 0) throw std::runtime_error(std::string("NFC normalization failed: ") + utf8proc_errmsg(n));
  out.append(reinterpret_cast<const char*>(dst), std::size_t(n));
}

}  // namespace

bool nfc(std::string_view s, std::string& out) {
  out.clear();
  // Every code point below U+0300 is NFC-stable and never composes with what precedes it: a text of
  // such characters only (lead bytes below 0xCC) is its own NFC.
  bool simple = true;
  for (unsigned char c : s)
    if (c >= 0xCC) {
      simple = false;
      break;
    }
  if (simple) return false;
  // A non-composing starter is a boundary NFC never crosses: normalize the text between the code
  // points tokenizers does not know, and keep those as they are.
  std::size_t seg = 0, marks = 0;
  bool long_run = false;  // a run of more than 32 non-starters in the current segment
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t b = i;
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      marks = 0;
      continue;
    }
    const char32_t c = next_utf8(s, i);
    if (nfc_unknown(c)) {
      utf8proc_nfc(s.substr(seg, b - seg), out, long_run);
      out.append(s.substr(b, i - b));
      seg = i;
      marks = 0;
      long_run = false;
    } else if (combining_class(c) != 0) {
      long_run |= ++marks > 32;
    } else {
      marks = 0;
    }
  }
  utf8proc_nfc(s.substr(seg), out, long_run);
  if (out == s) {
    out.clear();
    return false;
  }
  return true;
}

namespace {

// Number of code points in the full canonical decomposition of cp.
std::size_t nfd_length(char32_t cp) {
  utf8proc_int32_t buf[32];
  int boundclass = 0;
  const utf8proc_ssize_t n = utf8proc_decompose_char(utf8proc_int32_t(cp), buf, 32, UTF8PROC_DECOMPOSE, &boundclass);
  return n > 0 ? std::size_t(n) : 1;
}

}  // namespace

ByteAlignment nfc_alignment(std::string_view original, std::string_view normalized, uint32_t base) {
  // Original characters: byte range and start in the concatenated decompositions.
  struct Char {
    uint32_t begin, end;
    std::size_t d0, d1;
  };
  std::vector<Char> orig;
  std::size_t d = 0;
  for (std::size_t i = 0; i < original.size();) {
    const std::size_t b = i;
    const char32_t cp = next_utf8(original, i);
    const std::size_t len = nfd_length(cp);
    orig.push_back({uint32_t(b), uint32_t(i), d, d + len});
    d += len;
  }
  ByteAlignment a;
  a.begin.resize(normalized.size());
  a.end.resize(normalized.size());
  std::size_t e = 0, k = 0;
  for (std::size_t i = 0; i < normalized.size();) {
    const std::size_t b = i;
    const char32_t cp = next_utf8(normalized, i);
    const std::size_t e1 = e + nfd_length(cp);
    while (k + 1 < orig.size() && orig[k].d1 <= e) ++k;  // first original char ending after e
    std::size_t last = k;
    while (last + 1 < orig.size() && orig[last + 1].d0 < e1) ++last;
    const uint32_t ob = orig.empty() ? 0 : orig[k].begin + base;
    const uint32_t oe = orig.empty() ? 0 : orig[last].end + base;
    for (std::size_t j = b; j < i; ++j) {
      a.begin[j] = ob;
      a.end[j] = oe;
    }
    e = e1;
  }
  return a;
}

ByteLevelAlphabet::ByteLevelAlphabet() {
  for (auto& c : char_byte) c = -1;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int cp = printable ? b : next++;
    byte_char[b].clear();
    append_utf8(char32_t(cp), byte_char[b]);
    char_byte[cp] = int16_t(b);
  }
}

bool ByteLevelAlphabet::decode(std::string_view token, std::string& out) const {
  const std::size_t start = out.size();
  for (std::size_t i = 0; i < token.size();) {
    const int b = byte_of(next_utf8(token, i));
    if (b < 0) {
      out.resize(start);
      return false;
    }
    out += char(b);
  }
  return true;
}

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet a;
  return a;
}

}  // namespace dflash::text
