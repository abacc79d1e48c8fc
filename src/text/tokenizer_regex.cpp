#include "text/tokenizer_regex.h"

#include "text/tokenizer_unicode.h"

#include <pcre2.h>

#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

namespace dflash::text {

namespace {

// Unicode White_Space (Oniguruma's \s), as the inside of a character class.
constexpr const char* kWhiteSpace =
    R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// Letters and numbers of Unicode 15.0 and 16.0 (Oniguruma's tables in tokenizers 0.23) that
// PCRE2 10.42 (Unicode 14) lacks, found by probing both on every code point. Harmless with a PCRE2
// that already has them.
constexpr const char* kExtraLetters =
    R"(\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D4A}-\x{10D65}\x{10D6F}-\x{10D85})"
    R"(\x{10EC2}-\x{10EC4}\x{1123F}-\x{11240}\x{11380}-\x{11389}\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7})"
    R"(\x{113D1}\x{113D3}\x{11BC0}-\x{11BE0}\x{11F02}\x{11F04}-\x{11F10}\x{11F12}-\x{11F33}\x{1342F}\x{13441}-\x{13446})"
    R"(\x{13460}-\x{143FA}\x{16100}-\x{1611D}\x{16D40}-\x{16D6C}\x{18CFF}\x{1B132}\x{1B155}\x{1DF25}-\x{1DF2A})"
    R"(\x{1E030}-\x{1E06D}\x{1E4D0}-\x{1E4EB}\x{1E5D0}-\x{1E5ED}\x{1E5F0}\x{2B739}\x{2EBF0}-\x{2EE5D}\x{31350}-\x{323AF})";
constexpr const char* kExtraNumbers =
    R"(\x{10D40}-\x{10D49}\x{116D0}-\x{116E3}\x{11BF0}-\x{11BF9}\x{11F50}-\x{11F59}\x{16130}-\x{16139}\x{16D70}-\x{16D79})"
    R"(\x{1CCF0}-\x{1CCF9}\x{1D2C0}-\x{1D2D3}\x{1E4F0}-\x{1E4F9}\x{1E5F1}-\x{1E5FA})";

// Per-thread match state: match data (one pair is all find() reads), a match context and the JIT
// stack it uses.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    ctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (!data || !ctx) throw std::bad_alloc();
    // The split patterns are linear; their backtracking grows with the length of a run (a 20 MB run
    // of spaces exceeds PCRE2's default limits), so the limits only stop runaway patterns.
    pcre2_set_match_limit(ctx, UINT32_MAX);
    pcre2_set_depth_limit(ctx, UINT32_MAX);
    pcre2_set_heap_limit(ctx, 4u * 1024 * 1024);  // KiB: 4 GiB for the interpreter
    if (stack) pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(ctx);
    pcre2_match_data_free(data);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};

MatchState& match_state() {
  thread_local MatchState st;
  return st;
}

}  // namespace

std::string onig_compatible_pattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 'Q') {  // \Q...\E: copy verbatim
        const std::size_t end = p.find("\\E", i + 2);
        const std::size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i, stop - i));
        i = stop - 1;
        continue;
      }
      if (e == 's') {
        if (in_class) {
          out += kWhiteSpace;
        } else {
          out += '[';
          out += kWhiteSpace;
          out += ']';
        }
        ++i;
        continue;
      }
      if ((e == 'p' || e == 'P') && (p.substr(i + 2, 3) == "{L}" || p.substr(i + 2, 3) == "{N}")) {
        const char k = p[i + 3];  // L or N
        const std::string cls = std::string("\\p{") + k + "}";
        const char* extra = k == 'L' ? kExtraLetters : kExtraNumbers;
        if (e == 'P' && in_class) throw std::invalid_argument("\\P{L} / \\P{N} inside a character class is not supported");
        if (in_class) {
          out += cls;
          out += extra;
        } else {
          out += e == 'P' ? "[^" : "[";
          out += cls;
          out += extra;
          out += ']';
        }
        i += 4;
        continue;
      }
      if (e == 'S') {
        if (in_class) throw std::invalid_argument("\\S inside a character class is not supported");
        out += "[^";
        out += kWhiteSpace;
        out += ']';
        ++i;
        continue;
      }
      out += c;
      out += e;
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const std::size_t end = p.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(p.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

namespace {

pcre2_code* compile(const std::string& pat, const std::string& shown, bool literal) {
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP;
  if (literal) opts |= PCRE2_LITERAL;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), opts, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::invalid_argument("regex /" + shown + "/ does not compile (PCRE2): " + reinterpret_cast<const char*>(msg) +
                                " at offset " + std::to_string(off));
  }
  return code;
}

// The extra letters and numbers as code point ranges, parsed once from the class text above.
std::vector<std::pair<char32_t, char32_t>> parse_ranges(std::string_view cls) {
  std::vector<std::pair<char32_t, char32_t>> out;
  std::size_t i = 0;
  auto cp = [&] {  // \x{HEX}
    const std::size_t close = cls.find('}', i);
    const char32_t v = char32_t(std::stoul(std::string(cls.substr(i + 3, close - i - 3)), nullptr, 16));
    i = close + 1;
    return v;
  };
  while (i < cls.size()) {
    const char32_t a = cp();
    char32_t b = a;
    if (i < cls.size() && cls[i] == '-') {
      ++i;
      b = cp();
    }
    out.emplace_back(a, b);
  }
  return out;
}

}  // namespace

bool has_onig_divergent_chars(std::string_view s) {
  static const auto ranges = [] {
    auto r = parse_ranges(kExtraLetters);
    const auto n = parse_ranges(kExtraNumbers);
    r.insert(r.end(), n.begin(), n.end());
    r.emplace_back(0x180E, 0x180E);
    return r;
  }();
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = p[i];
    // Lead bytes of U+1000..U+1FFF (U+180E, U+1C89..), U+A000..U+AFFF (U+A7CB..) and planes 1-16.
    if (c != 0xE1 && c != 0xEA && c < 0xF0) continue;
    std::size_t j = i;
    const char32_t cp = next_utf8(s, j);
    for (const auto& [a, b] : ranges)
      if (cp >= a && cp <= b) return true;
    i = j - 1;
  }
  return false;
}

SplitRegex::SplitRegex(const std::string& pattern, bool literal) {
  fast_ = compile(pattern, pattern, literal);
  try {  // (a throwing constructor runs no destructor: free fast_ here)
    if (!literal) {
      const std::string exact = onig_compatible_pattern(pattern);
      if (exact != pattern) exact_ = compile(exact, pattern, false);
    }
  } catch (...) {
    pcre2_code_free(fast_);
    throw;
  }
  jit_ = pcre2_jit_compile(fast_, PCRE2_JIT_COMPLETE) == 0 && (!exact_ || pcre2_jit_compile(exact_, PCRE2_JIT_COMPLETE) == 0);
}

SplitRegex::~SplitRegex() {
  pcre2_code_free(exact_);
  pcre2_code_free(fast_);
}

bool SplitRegex::find(const char* s, std::size_t n, std::size_t from, std::size_t* begin, std::size_t* end, bool exact) const {
  MatchState& st = match_state();
  const pcre2_code* code = exact && exact_ ? exact_ : fast_;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s);
  while (from < n) {
    int rc;
    if (jit_) {
      rc = pcre2_jit_match(code, subject, n, from, 0, st.data, st.ctx);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(code, subject, n, from, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, st.data, st.ctx);
    } else {
      rc = pcre2_match(code, subject, n, from, PCRE2_NO_UTF_CHECK, st.data, st.ctx);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw std::runtime_error(std::string("pre-tokenizer regex match failed (PCRE2): ") +
                               reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    if (ov[1] > ov[0]) {
      *begin = ov[0];
      *end = ov[1];
      return true;
    }
    // Empty match: look again from the next character.
    from = ov[0] + 1;
    while (from < n && (static_cast<unsigned char>(s[from]) & 0xC0) == 0x80) ++from;
  }
  return false;
}

}  // namespace dflash::text
