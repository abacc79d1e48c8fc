#include "ops/linear.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "ops/cpu/blas.h"

namespace dflash::cpu {

template <typename T>
BasicTensor<T> linear(const BasicTensor<T>& x, const BasicTensor<T>& w, const char* what) {
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape.back() != w.dim(1))
    throw std::invalid_argument(std::string(what) + ": input " + shape_str(x.shape) +
                                " does not match weight " + shape_str(w.shape));
  const int64_t in = w.dim(1), out = w.dim(0), N = x.numel() / std::max<int64_t>(in, 1);
  std::vector<int64_t> shape = x.shape;
  shape.back() = out;
  BasicTensor<T> y(shape);
  if (N == 0 || out == 0 || in == 0) return y;
  blas::gemm(false, true, int(N), int(out), int(in), T(1), x.ptr(), int(in), w.ptr(), int(in), T(0), y.ptr(),
             int(out));
  return y;
}

template <typename T>
void linear_backward(const BasicTensor<T>& x, const BasicTensor<T>& w, const BasicTensor<T>& dy,
                     OutTensor<T>* dx, OutTensor<T>* dw, const char* what) {
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape.back() != w.dim(1) || dy.ndim() != x.ndim() ||
      dy.shape.back() != w.dim(0) || !std::equal(x.shape.begin(), x.shape.end() - 1, dy.shape.begin()))
    throw std::invalid_argument(std::string(what) + ": x " + shape_str(x.shape) + ", w " + shape_str(w.shape) +
                                ", dy " + shape_str(dy.shape));
  const int64_t in = w.dim(1), out = w.dim(0), N = x.numel() / std::max<int64_t>(in, 1);
  if (dx) {
    *dx = BasicTensor<T>(x.shape);
    if (N > 0 && in > 0 && out > 0)
      blas::gemm(false, false, int(N), int(in), int(out), T(1), dy.ptr(), int(out), w.ptr(), int(in), T(0),
                 dx->ptr(), int(in));
  }
  if (dw) {
    if (dw->numel() == 0 && dw->shape != w.shape) *dw = BasicTensor<T>(w.shape);
    if (dw->shape != w.shape)
      throw std::invalid_argument(std::string(what) + ": dw " + shape_str(dw->shape) + " vs w " + shape_str(w.shape));
    if (N > 0 && in > 0 && out > 0)
      blas::gemm(true, false, int(out), int(in), int(N), T(1), dy.ptr(), int(out), x.ptr(), int(in), T(1),
                 dw->ptr(), int(in));
  }
}

template Tensor linear<float>(const Tensor&, const Tensor&, const char*);
template Tensor64 linear<double>(const Tensor64&, const Tensor64&, const char*);
template void linear_backward<float>(const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*, const char*);
template void linear_backward<double>(const Tensor64&, const Tensor64&, const Tensor64&, Tensor64*, Tensor64*,
                                      const char*);

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
