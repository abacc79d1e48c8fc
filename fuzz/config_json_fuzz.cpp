// libFuzzer target: a model's config.json (transformers layouts) and a DFlash drafter config.json.
#include <exception>

#include <nlohmann/json.hpp>

#include "models/hf_config.h"
#include "models/drafter_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  try {
    (void)dflash::model_spec_from_hf_config(j, "fuzz config.json");
  } catch (const std::exception&) {
  }
  try {
    const dflash::DrafterConfig c = dflash::drafter_config_from_json(j, "fuzz drafter config.json");
    c.validate("fuzz");
  } catch (const std::exception&) {
  }
  return 0;
}
