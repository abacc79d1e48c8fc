// libFuzzer target: SafetensorsFile on arbitrary bytes (header JSON, dtypes, shapes, offsets).
#include <exception>

#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dflash::fuzz::write_input(data, size, "model.safetensors");
  try {
    const dflash::SafetensorsFile f(path);
    unsigned sum = 0;
    for (const auto& t : f.tensors()) {
      const auto* p = static_cast<const unsigned char*>(f.data(t.name));
      const size_t n = f.nbytes(t.name);
      if (n) sum += p[0] + p[n - 1];  // the whole declared range must lie inside the file
    }
    for (const auto& [k, v] : f.metadata()) sum += unsigned(k.size() + v.size());
    (void)sum;
  } catch (const std::exception&) {
  }
  return 0;
}
