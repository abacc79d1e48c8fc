#include <algorithm>
#include "ops/linear.h"

#include <cblas.h>

#include <stdexcept>
#include <string>

namespace dflash::cpu {

Tensor linear(const Tensor& x, const Tensor& w, const char* what) {
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape.back() != w.dim(1))
    throw std::invalid_argument(std::string(what) + ": input " + shape_str(x.shape) +
                                " does not match weight " + shape_str(w.shape));
  const int64_t in = w.dim(1), out = w.dim(0), T = x.numel() / std::max<int64_t>(in, 1);
  std::vector<int64_t> shape = x.shape;
  shape.back() = out;
  Tensor y(shape);
  if (T == 0 || out == 0) return y;
  if (in == 0) return y;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(T), int(out), int(in), 1.0f, x.ptr(), int(in),
              w.ptr(), int(in), 0.0f, y.ptr(), int(out));
  return y;
}

Tensor embedding(const Tensor& table, const std::vector<int32_t>& ids) {
  const int64_t V = table.dim(0), D = table.dim(1);
  Tensor y({int64_t(ids.size()), D});
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t] < 0 || ids[t] >= V)
      throw std::out_of_range("embedding: token id " + std::to_string(ids[t]) + " at position " +
                              std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    std::copy_n(table.row(ids[t]), D, y.row(int64_t(t)));
  }
  return y;
}

}  // namespace dflash::cpu
