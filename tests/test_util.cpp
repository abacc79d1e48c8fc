#include "test_util.h"

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <sys/wait.h>

namespace dflash::test {

std::vector<double> read_f64(const SafetensorsFile& f, const std::string& name, std::vector<int64_t>* shape) {
  const TensorInfo* info = f.find(name);
  if (!info) throw std::runtime_error(f.path() + ": no tensor " + name);
  if (shape) *shape = info->shape;
  const std::size_t n = std::size_t(Tensor::numel_of(info->shape));
  const char* p = static_cast<const char*>(f.data(name));
  std::vector<double> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (info->dtype == DType::F64) {
      std::memcpy(&out[i], p + 8 * i, 8);
    } else if (info->dtype == DType::F32) {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = v;
    } else if (info->dtype == DType::I64) {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      out[i] = double(v);
    } else {
      throw std::runtime_error("read_f64: unsupported dtype " + dtype_name(info->dtype) + " for " + name);
    }
  }
  return out;
}

TargetGolden load_target_golden(const std::filesystem::path& dir, const std::string& file) {
  auto g = SafetensorsCheckpoint::open((dir / file).string());
  TargetGolden r;
  for (int s = 0;; ++s) {
    const std::string p = "seq" + std::to_string(s) + ".";
    if (!g->has(p + "input_ids")) break;
    Tensor ids = g->load_f32(p + "input_ids");
    r.ids.emplace_back(ids.data.begin(), ids.data.end());
    r.logits.push_back(g->load_f32(p + "logits"));
    r.hidden.emplace_back();
    for (int j = 0; g->has(p + "hidden_states." + std::to_string(j)); ++j)
      r.hidden.back().push_back(g->load_f32(p + "hidden_states." + std::to_string(j)));
  }
  r.num_layers = r.hidden.empty() ? 0 : int(r.hidden[0].size()) - 1;
  return r;
}

std::vector<int64_t> read_i64(const SafetensorsFile& f, const std::string& name) {
  const std::vector<double> v = read_f64(f, name);
  return std::vector<int64_t>(v.begin(), v.end());
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
