// UTF-8 and Unicode helpers of the tokenizer (internal): validation, lossy decoding as Rust's
// String::from_utf8_lossy, NFC (utf8proc) with a byte alignment back to the input, and the GPT-2
// byte-level alphabet.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::text {

/// Byte offset of the first byte of `s` that is not part of a well-formed UTF-8 sequence
/// (overlongs, surrogates and code points above U+10FFFF are ill-formed), or s.size() when all of
/// `s` is valid.
std::size_t utf8_invalid_offset(std::string_view s);

/// Appends `bytes` to `out` as valid UTF-8, each maximal ill-formed subpart replaced by U+FFFD (the
/// Unicode "substitution of maximal subparts" that Rust's from_utf8_lossy implements).
void append_utf8_lossy(std::string_view bytes, std::string& out);

/// Appends code point `cp` (<= 0x10FFFF) as UTF-8.
void append_utf8(char32_t cp, std::string& out);

/// Decodes one well-formed UTF-8 character at s[i] (i < s.size()), returning the code point and
/// advancing i past it. Input must be valid UTF-8.
char32_t next_utf8(std::string_view s, std::size_t& i);

/// NFC of valid UTF-8 `s` into `out`. Returns false (and leaves `out` empty) when `s` is already in
/// NFC, which is decided without utf8proc for text below U+0300. Throws std::runtime_error when
/// utf8proc fails.
bool nfc(std::string_view s, std::string& out);

/// Where each byte of a normalized text comes from in the input: bytes [begin[i], end[i]) of it.
struct ByteAlignment {
  std::vector<uint32_t> begin, end;
};

/// For `normalized` == NFC(`original`) (both valid UTF-8), the input byte range of every byte of
/// `normalized`: each normalized character maps to the input characters whose canonical
/// decompositions overlap its own in the canonical decomposition of the whole text (a composed
/// character covers its base and marks; all bytes of a character share the range), offset by
/// `base`.
ByteAlignment nfc_alignment(std::string_view original, std::string_view normalized, uint32_t base);

/// The GPT-2 byte-level alphabet (tokenizers' bytes_char): every byte maps to one printable
/// character: '!'..'~', U+00A1..U+00AC and U+00AE..U+00FF map to themselves, the other 68 bytes to
/// U+0100.. in byte order.
struct ByteLevelAlphabet {
  ByteLevelAlphabet();
  /// UTF-8 of the character for each byte.
  std::string byte_char[256];
  /// Byte of a character of the alphabet, or -1 (index: code point below 324).
  int16_t char_byte[324];
  /// The byte of code point `cp`, or -1 when it is not in the alphabet.
  int byte_of(char32_t cp) const { return cp < 324 ? char_byte[cp] : -1; }
  /// Maps every character of valid UTF-8 `token` back to its byte; false (out unchanged) when a
  /// character is not in the alphabet.
  bool decode(std::string_view token, std::string& out) const;
};
const ByteLevelAlphabet& byte_level_alphabet();

}  // namespace dflash::text
