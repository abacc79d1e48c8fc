#include "test_util.h"

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <stdexcept>
#include <sys/wait.h>

namespace dflash::test {

double rel_l2(const float* a, const float* b, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (!std::isfinite(num)) return INFINITY;
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

namespace {
// Compiled-in paths, overridable at run time (a test binary carried to another machine).
std::filesystem::path env_or(const char* var, const char* compiled) {
  const char* v = std::getenv(var);
  return v && *v ? v : compiled;
}
}  // namespace

std::filesystem::path source_dir() { return env_or("DFLASH_SOURCE_DIR", DFLASH_SOURCE_DIR); }
std::filesystem::path fixtures_dir() { return source_dir() / "tests" / "fixtures"; }
std::filesystem::path dflash_binary() { return env_or("DFLASH_BINARY", DFLASH_BINARY); }

TempDir::TempDir() {
  std::random_device rd;
  for (int i = 0; i < 100; ++i) {
    auto p = std::filesystem::temp_directory_path() / ("dflash_test_" + std::to_string(rd()));
    if (std::filesystem::create_directory(p)) {
      path_ = p;
      return;
    }
  }
  throw std::runtime_error("TempDir: cannot create a temp directory");
}
TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  if (!f) throw std::runtime_error("write_file: cannot write " + p.string());
}

int run_command(const std::string& cmd, std::string* output) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::array<char, 4096> buf;
  std::string out;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  if (output) *output = out;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace dflash::test
