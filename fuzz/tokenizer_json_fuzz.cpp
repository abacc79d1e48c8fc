// libFuzzer target: tokenizer.json (BPE vocabulary, merges, added tokens, pre-tokenizer regex,
// normalizer), then encode + decode of a fixed text through the result.
#include <exception>

#include "fuzz_util.h"
#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dflash::fuzz::write_input(data, size, "tokenizer.json");
  try {
    const auto tok = dflash::Tokenizer::from_tokenizer_json(path);
    const auto ids = tok->encode("Hello, world! 123 <|im_start|>user\nĉa va? \xF0\x9F\x98\x80", true);
    (void)tok->decode(ids);
  } catch (const std::exception&) {
  }
  return 0;
}
