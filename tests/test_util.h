// Shared helpers for the test suite: tolerances, paths, temp dirs.
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "tensor/tensor.h"

namespace dflash::test {

/// The one tolerance table of the project (normalized error ||a - b|| / ||b||).
/// CPU float32 reference vs transformers float32 goldens:
inline constexpr double kTolF32 = 1e-5;

/// d f / d h at 0 by the 4th-order central difference (8 (f(h) - f(-h)) - (f(2h) - f(-2h))) / (12 h).
template <typename F>
double central_difference(F f, double h) {
  return (8 * (f(h) - f(-h)) - (f(2 * h) - f(-2 * h))) / (12 * h);
}

/// ||a - b||_2 / ||b||_2 accumulated in double (0 when both are zero; infinite when b is zero and a
/// is not, or on NaN/Inf; 1e30 when the sizes differ).
template <typename A, typename B>
double rel_l2(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return 1e30;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (!std::isfinite(num)) return INFINITY;
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

/// A tensor of a safetensors file as doubles, read from its raw bytes (F64, F32 or I64; load_f32 would
/// round F64). Fills *shape when given. Throws std::runtime_error for a missing tensor or other dtype.
std::vector<double> read_f64(const SafetensorsFile& f, const std::string& name, std::vector<int64_t>* shape = nullptr);
/// The same as a BasicTensor<T> with its shape.
template <typename T>
BasicTensor<T> read_tensor(const SafetensorsFile& f, const std::string& name) {
  BasicTensor<T> t;
  const std::vector<double> v = read_f64(f, name, &t.shape);
  t.data.assign(v.begin(), v.end());
  return t;
}
/// An integer tensor (I64, or exact integers in a float tensor).
std::vector<int64_t> read_i64(const SafetensorsFile& f, const std::string& name);

/// A target fixture's golden outputs (tests/fixtures/<name>/golden.safetensors, written by
/// scripts/make_fixtures.py): per sequence the ids, logits [T, V] and hidden_states j = 0..L.
struct TargetGolden {
  std::vector<std::vector<int32_t>> ids;
  std::vector<Tensor> logits;
  std::vector<std::vector<Tensor>> hidden;  // [seq][j]
  int num_layers = 0;
};
/// Reads DIR/FILE (scripts/make_fixtures.py: golden.safetensors, or golden_bf16_weights.safetensors,
/// the exact forward with the weights rounded to bf16 as the GPU holds them).
TargetGolden load_target_golden(const std::filesystem::path& dir, const std::string& file = "golden.safetensors");

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
