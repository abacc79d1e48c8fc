#include "io/json_file.h"

#include <stdexcept>

#include "io/mapped_file.h"

namespace dflash {

nlohmann::json read_json_file(const std::string& path, uint64_t max_bytes) {
  const std::string text = read_small_file(path, max_bytes);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    std::string why = e.what();
    if (why.size() > 300) why = why.substr(0, 300) + "...";
    throw std::runtime_error(path + ": not valid JSON: " + why);
  }
}

}  // namespace dflash
