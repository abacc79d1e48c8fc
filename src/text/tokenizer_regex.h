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

/// `pattern` with \s and \S spelled out as Unicode White_Space (what Oniguruma's \s matches; PCRE2's
/// own \s also matches U+180E). Throws std::invalid_argument for \S inside a character class.
std::string onig_compatible_pattern(std::string_view pattern);

/// A compiled regex. Immutable; find() is safe from many threads at once (match data is
/// thread_local).
class SplitRegex {
 public:
  /// Compiles `pattern` (a literal string when `literal`) with PCRE2_UTF | PCRE2_UCP, rewritten by
  /// onig_compatible_pattern, and JIT-compiles it when PCRE2 has JIT. Throws std::invalid_argument
  /// with PCRE2's message and the offset of the error.
  SplitRegex(const std::string& pattern, bool literal);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  /// The first non-empty match in s[from, n) of `s` (valid UTF-8; the pattern sees only s[0, n)),
  /// as [*begin, *end); false when there is none.
  bool find(const char* s, std::size_t n, std::size_t from, std::size_t* begin, std::size_t* end) const;
  bool jit() const { return jit_; }

 private:
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace dflash::text
