// Shared helpers for the test suite: tolerances, paths, temp dirs.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dflash::test {

/// The one tolerance table of the project (normalized error ||a - b|| / ||b||).
/// CPU float32 reference vs transformers float32 goldens:
inline constexpr double kTolF32 = 1e-5;

/// ||a - b||_2 / ||b||_2 (0 when both are zero). Sizes must match.
double rel_l2(const float* a, const float* b, std::size_t n);
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() ? rel_l2(a.data(), b.data(), a.size()) : 1e30;
}

/// Source tree root and the committed fixtures directory (env DFLASH_SOURCE_DIR overrides).
std::filesystem::path source_dir();
std::filesystem::path fixtures_dir();
/// Path to the built `dflash` executable (env DFLASH_BINARY overrides).
std::filesystem::path dflash_binary();

/// A fresh, empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

/// Writes raw bytes to a file (for hostile-input tests).
void write_file(const std::filesystem::path& p, const std::string& bytes);
/// Runs a shell command; returns its exit status and fills `output` with stdout+stderr.
int run_command(const std::string& cmd, std::string* output);

}  // namespace dflash::test
