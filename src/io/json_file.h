// Reading a whole JSON file (configs, indexes, manifests) with errors that name the file.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace dflash {

/// Parses the regular file `path` (at most `max_bytes`). Throws std::runtime_error
/// "<path>: cannot open: ..." / "<path>: not valid JSON: <parser message>".
nlohmann::json read_json_file(const std::string& path, uint64_t max_bytes = uint64_t(64) << 20);

/// Writes `text` to `path` atomically: a temporary "<path>.tmp-<pid>" is written and flushed, then
/// renamed over `path` (a reader never sees half a file). Throws std::runtime_error naming the file.
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace dflash
