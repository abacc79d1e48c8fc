// Reading a whole JSON file (configs, indexes, manifests) with errors that name the file.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace dflash {

/// Parses the regular file `path` (at most `max_bytes`). Throws std::runtime_error
/// "<path>: cannot open: ..." / "<path>: not valid JSON: <parser message>".
nlohmann::json read_json_file(const std::string& path, uint64_t max_bytes = uint64_t(64) << 20);

}  // namespace dflash
