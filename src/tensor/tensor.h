// Host tensor used by the CPU reference path: float32, contiguous, row-major, shapes in PyTorch order.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

namespace dflash {

/// A contiguous float32 host tensor. `shape` is in PyTorch order (e.g. [T, D]); `data` holds
/// numel() values, row-major. The CPU reference computes in this type; device tensors come later.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> s) : shape(std::move(s)), data(size_t(numel_of(shape)), 0.0f) {}

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
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
  /// Row r of a 2-D tensor [R, C].
  float* row(int64_t r) { return data.data() + r * shape.back(); }
  const float* row(int64_t r) const { return data.data() + r * shape.back(); }
};

/// "[2, 3, 4]" for messages.
std::string shape_str(const std::vector<int64_t>& s);

/// Copy of rows [b, e) along dim 0 of `t` (any rank). Throws std::out_of_range for a bad range.
Tensor slice_rows(const Tensor& t, int64_t b, int64_t e);

}  // namespace dflash
