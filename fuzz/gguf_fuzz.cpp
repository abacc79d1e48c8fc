// libFuzzer target: GGUFFile on arbitrary bytes (header, metadata values and arrays, tensor infos),
// then the dequantization of its small tensors and the GGUF tokenizer reader.
#include <exception>

#include "fuzz_util.h"
#include "io/gguf.h"
#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dflash::fuzz::write_input(data, size, "model.gguf");
  try {
    const dflash::GGUFFile g(path);
    for (const auto& t : g.tensors()) {
      const unsigned char* p = g.data(t.name);
      if (t.nbytes) (void)(p[0] + p[t.nbytes - 1]);
      if (t.numel <= (1 << 16) && dflash::ggml_can_dequantize(t.type)) (void)g.dequantize(t.name);
    }
    try {
      (void)dflash::Tokenizer::from_gguf(g);
    } catch (const std::exception&) {
    }
  } catch (const std::exception&) {
  }
  return 0;
}
