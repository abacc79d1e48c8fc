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

/// The one tolerance table of the project (normalized error ||a - b|| / ||b||), each bound with
/// what it covers and why. Tests use these names, not numbers of their own.
/// float32 against float32 / float64 of the same math (transformers' float32 goldens, the fp32 GPU
/// kernels): only the summation order (and fast exp) differ.
inline constexpr double kTolF32 = 1e-5;
/// float64 analytic gradients against central differences.
inline constexpr double kTolFiniteDifference = 1e-6;
/// The chunked GatedDeltaNet against the token recurrence: another fp32 summation order over up to
/// 4097 steps (output and final state).
inline constexpr double kTolGdnChunked = 1e-4;
/// One bf16 rounding of an fp32 result (2^-9 relative at most, ~1.1e-3 on random data) plus
/// fp32-vs-fp64 noise: GEMM and FP8 product outputs in bf16.
inline constexpr double kTolBf16Out = 4e-3;
/// The GatedDeltaNet kernels' bf16 outputs (fp32 recurrence with fast exp, then one bf16 rounding).
inline constexpr double kTolBf16OutGdn = 5e-3;
/// The GPU attention (bf16 inputs and outputs, probabilities rounded to bf16 before the P.V / dS
/// products, as every flash-attention kernel does) against float64 on the same inputs.
inline constexpr double kTolBf16Attention = 1e-2;
/// A whole target forward on the GPU (bf16 weights and GEMM inputs through 2 layers, fp32
/// accumulation and residual) against transformers.
inline constexpr double kTolBf16Target = 1e-2;
/// A whole drafter training step in bf16 (activations and gradients rounded at every op) against
/// fp32: a few bf16 unit roundoffs through 2 layers.
inline constexpr double kTolBf16DrafterStep = 3e-2;
/// E4M3 products with fp32 output against the exact sum of the dequantized operands: Hopper's FP8
/// tensor cores add with an accumulator of about 14 bits (DeepSeek-V3 technical report, 3.3.2);
/// 2^-12 (1e-4 measured at K 512 on an H100).
inline constexpr double kTolFp8Accumulate = 2.5e-4;

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
