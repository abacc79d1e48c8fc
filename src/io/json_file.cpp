#include "io/json_file.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
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

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f << text;
    f.close();
    if (!f) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      throw std::runtime_error("cannot write " + tmp);
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw std::runtime_error("cannot write " + path + ": " + ec.message());
}

}  // namespace dflash
