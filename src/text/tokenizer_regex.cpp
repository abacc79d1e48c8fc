#include "text/tokenizer_regex.h"

#include <pcre2.h>

#include <stdexcept>

namespace dflash::text {

namespace {

// Unicode White_Space (Oniguruma's \s), as the inside of a character class.
constexpr const char* kWhiteSpace =
    R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

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

SplitRegex::SplitRegex(const std::string& pattern, bool literal) {
  const std::string pat = literal ? pattern : onig_compatible_pattern(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP;
  if (literal) opts |= PCRE2_LITERAL;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), opts, &err, &off, nullptr);
  if (!code_) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::invalid_argument("regex /" + pattern + "/ does not compile (PCRE2): " +
                                reinterpret_cast<const char*>(msg) + " at offset " + std::to_string(off));
  }
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

SplitRegex::~SplitRegex() { pcre2_code_free(code_); }

bool SplitRegex::find(const char* s, std::size_t n, std::size_t from, std::size_t* begin, std::size_t* end) const {
  MatchState& st = match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s);
  while (from < n) {
    int rc;
    if (jit_) {
      rc = pcre2_jit_match(code_, subject, n, from, 0, st.data, st.ctx);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(code_, subject, n, from, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, st.data, st.ctx);
    } else {
      rc = pcre2_match(code_, subject, n, from, PCRE2_NO_UTF_CHECK, st.data, st.ctx);
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
