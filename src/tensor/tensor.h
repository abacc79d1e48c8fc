// Host tensor used by the CPU reference path: contiguous, row-major, shapes in PyTorch order.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace dflash {

/// A contiguous host tensor of element type T. `shape` is in PyTorch order (e.g. [T, D]); `data`
/// holds numel() values, row-major. The CPU reference computes in `Tensor` (float32); `Tensor64`
/// (float64) exists for finite-difference gradient checks of the hand-written backwards.
template <typename T>
struct BasicTensor {
  using value_type = T;
  std::vector<int64_t> shape;
  std::vector<T> data;

  BasicTensor() = default;
  explicit BasicTensor(std::vector<int64_t> s) : shape(std::move(s)), data(size_t(numel_of(shape)), T(0)) {}

  /// Product of the dims; throws std::invalid_argument for a negative dim or an int64 overflow.
  static int64_t numel_of(const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) {
      if (d < 0) throw std::invalid_argument("Tensor: negative dimension");
      if (__builtin_mul_overflow(n, d, &n)) throw std::invalid_argument("Tensor: element count overflows int64");
    }
    return n;
  }
  int64_t numel() const { return int64_t(data.size()); }
  int64_t dim(int i) const { return shape.at(size_t(i < 0 ? int(shape.size()) + i : i)); }
  int ndim() const { return int(shape.size()); }
  T* ptr() { return data.data(); }
  const T* ptr() const { return data.data(); }
  /// Row r of a 2-D tensor [R, C].
  T* row(int64_t r) { return data.data() + r * shape.back(); }
  const T* row(int64_t r) const { return data.data() + r * shape.back(); }
};

using Tensor = BasicTensor<float>;
using Tensor64 = BasicTensor<double>;

/// BasicTensor<T> excluded from template argument deduction: the type of the optional output
/// parameters (`OutTensor<T>* dx`) of the templated ops, so that callers may pass nullptr.
template <typename T>
using OutTensor = std::type_identity_t<BasicTensor<T>>;

/// "[2, 3, 4]" for messages.
std::string shape_str(const std::vector<int64_t>& s);

/// Copy of rows [b, e) along dim 0 of `t` (any rank). Throws std::out_of_range for a bad range.
template <typename T>
BasicTensor<T> slice_rows(const BasicTensor<T>& t, int64_t b, int64_t e) {
  if (t.ndim() == 0 || b < 0 || e < b || e > t.dim(0))
    throw std::out_of_range("slice_rows: rows [" + std::to_string(b) + ", " + std::to_string(e) + ") of " +
                            shape_str(t.shape));
  const int64_t inner = t.dim(0) ? t.numel() / t.dim(0) : 0;
  BasicTensor<T> r;
  r.shape = t.shape;
  r.shape[0] = e - b;
  r.data.assign(t.data.begin() + b * inner, t.data.begin() + e * inner);
  return r;
}

/// Element-type conversion (e.g. Tensor64 -> Tensor for float32-vs-float64 comparisons).
template <typename To, typename From>
BasicTensor<To> tensor_cast(const BasicTensor<From>& t) {
  BasicTensor<To> r;
  r.shape = t.shape;
  r.data.assign(t.data.begin(), t.data.end());
  return r;
}

}  // namespace dflash
