// The pre-tokenizer's split regex (internal): PCRE2 with UTF + UCP, JIT-compiled when the library
// supports it, with the matching rules of tokenizers' Oniguruma regexes.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

struct pcre2_real_code_8;

namespace dflash::text {

/// The GPT-2 pre-tokenizer pattern (tokenizers' ByteLevel with use_regex = true).
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

/// `pattern` rewritten so that PCRE2 matches what tokenizers' Oniguruma (Unicode 16 tables) does:
/// \s and \S spelled out as Unicode White_Space (PCRE2's own \s also matches U+180E), and \p{L},
/// \p{N} (\P{L}, \P{N}) extended by the letters and numbers of Unicode 15 and 16 that PCRE2 10.42
/// (Unicode 14) lacks. Other properties are left as they are. Throws std::invalid_argument for \S,
/// \P{L} or \P{N} inside a character class.
std::string onig_compatible_pattern(std::string_view pattern);

/// True when valid UTF-8 `s` holds a code point on which PCRE2's and Oniguruma's \s, \p{L} or
/// \p{N} disagree (U+180E, or a letter / number of Unicode 15 or 16).
bool has_onig_divergent_chars(std::string_view s);

/// A compiled split regex. Immutable; find() is safe from many threads at once (match data is
/// thread_local).
///
/// Two programs: `pattern` as PCRE2 reads it (fast) and onig_compatible_pattern(pattern) (exact,
/// about twice slower: its classes are longer). On text without has_onig_divergent_chars both
/// match the same, so find() takes the exact one only when the caller says the text needs it.
class SplitRegex {
 public:
  /// Compiles `pattern` (a literal string when `literal`) with PCRE2_UTF | PCRE2_UCP and
  /// JIT-compiles it when PCRE2 has JIT. Throws std::invalid_argument with PCRE2's message and the
  /// offset of the error.
  SplitRegex(const std::string& pattern, bool literal);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  /// The first non-empty match in s[from, n) of `s` (valid UTF-8; the pattern sees only s[0, n)),
  /// as [*begin, *end); false when there is none. `exact`: use the Oniguruma-compatible program
  /// (required when s[0, n) has_onig_divergent_chars).
  bool find(const char* s, std::size_t n, std::size_t from, std::size_t* begin, std::size_t* end, bool exact) const;

 private:
  pcre2_real_code_8* fast_ = nullptr;
  pcre2_real_code_8* exact_ = nullptr;  // nullptr: same as fast_
  bool jit_ = false;
};

}  // namespace dflash::text
