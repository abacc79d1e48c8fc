// Shared by the libFuzzer targets (fuzz/*_fuzz.cpp): the loaders read files, so each input is
// written to a per-process temporary file first. Every target expects a clear C++ exception for a
// bad input; a crash, a sanitizer report, a leak or a hang is a bug (scripts/fuzz.sh).
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace dflash::fuzz {

/// Writes the input to /tmp/dflash-fuzz-<pid>/<name> (the directory made once) and returns the path.
inline std::string write_input(const uint8_t* data, size_t size, const std::string& name) {
  static const std::string dir = [] {
    const std::string d = "/tmp/dflash-fuzz-" + std::to_string(getpid());
    std::filesystem::create_directories(d);
    return d;
  }();
  const std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

}  // namespace dflash::fuzz
