#include "ops/norm.h"

#include <cmath>
#include <stdexcept>

#include "ops/activation.h"

namespace dflash::cpu {

namespace {
float inv_rms(const float* x, int64_t d, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < d; ++i) ss += double(x[i]) * x[i];
  return float(1.0 / std::sqrt(ss / double(d) + eps));
}
}  // namespace

void rms_norm(Tensor& x, const Tensor& w, double eps, bool zero_centered) {
  const int64_t d = w.numel();
  if (d == 0 || x.ndim() == 0 || x.shape.back() != d)
    throw std::invalid_argument("rms_norm: input " + shape_str(x.shape) + " vs weight " + shape_str(w.shape));
  const int64_t rows = x.numel() / d;
  for (int64_t r = 0; r < rows; ++r) {
    float* p = x.ptr() + r * d;
    const float s = inv_rms(p, d, eps);
    for (int64_t i = 0; i < d; ++i) p[i] = p[i] * s * (zero_centered ? 1.0f + w.data[i] : w.data[i]);
  }
}

void gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, double eps) {
  const int64_t d = w.numel();
  if (x.numel() != z.numel() || d == 0 || x.numel() % d != 0)
    throw std::invalid_argument("gated_rms_norm: x " + shape_str(x.shape) + ", z " + shape_str(z.shape) +
                                ", weight " + shape_str(w.shape));
  const int64_t rows = x.numel() / d;
  for (int64_t r = 0; r < rows; ++r) {
    float* p = x.ptr() + r * d;
    const float* g = z.ptr() + r * d;
    const float s = inv_rms(p, d, eps);
    for (int64_t i = 0; i < d; ++i) p[i] = w.data[i] * (p[i] * s) * silu(g[i]);
  }
}

void l2_norm(float* x, int64_t rows, int64_t d, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = x + r * d;
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(p[i]) * p[i];
    const float s = float(1.0 / std::sqrt(ss + eps));
    for (int64_t i = 0; i < d; ++i) p[i] *= s;
  }
}

template <typename T>
BasicTensor<T> rms_norm_forward(const BasicTensor<T>& x, const BasicTensor<T>& w, double eps,
                                OutTensor<T>* inv_rms) {
  const int64_t d = w.numel();
  if (d == 0 || w.ndim() != 1 || x.ndim() == 0 || x.shape.back() != d)
    throw std::invalid_argument("rms_norm_forward: input " + shape_str(x.shape) + " vs weight " + shape_str(w.shape));
  const int64_t rows = x.numel() / d;
  BasicTensor<T> y(x.shape);
  if (inv_rms) *inv_rms = BasicTensor<T>({rows});
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = x.ptr() + r * d;
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(p[i]) * double(p[i]);
    const T s = T(1.0 / std::sqrt(ss / double(d) + eps));
    if (inv_rms) inv_rms->data[size_t(r)] = s;
    T* q = y.ptr() + r * d;
    for (int64_t i = 0; i < d; ++i) q[i] = w.data[size_t(i)] * (p[i] * s);
  }
  return y;
}

template <typename T>
void rms_norm_backward(const BasicTensor<T>& x, const BasicTensor<T>& w, const BasicTensor<T>& inv_rms,
                       const BasicTensor<T>& dy, OutTensor<T>* dx, OutTensor<T>* dw) {
  const int64_t d = w.numel();
  if (d == 0 || w.ndim() != 1 || x.ndim() == 0 || x.shape.back() != d || dy.shape != x.shape ||
      inv_rms.numel() != x.numel() / d)
    throw std::invalid_argument("rms_norm_backward: x " + shape_str(x.shape) + ", w " + shape_str(w.shape) +
                                ", inv_rms " + shape_str(inv_rms.shape) + ", dy " + shape_str(dy.shape));
  const int64_t rows = x.numel() / d;
  if (dx) *dx = BasicTensor<T>(x.shape);
  if (dw) {
    if (dw->numel() == 0 && dw->shape != w.shape) *dw = BasicTensor<T>(w.shape);
    if (dw->shape != w.shape)
      throw std::invalid_argument("rms_norm_backward: dw " + shape_str(dw->shape) + " vs w " + shape_str(w.shape));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x.ptr() + r * d;
    const T* g = dy.ptr() + r * d;
    const T s = inv_rms.data[size_t(r)];
    if (dw)
      for (int64_t i = 0; i < d; ++i) dw->data[size_t(i)] += g[i] * (xr[i] * s);
    if (!dx) continue;
    T dot = 0;  // sum_i w_i dy_i x_hat_i
    for (int64_t i = 0; i < d; ++i) dot += w.data[size_t(i)] * g[i] * (xr[i] * s);
    const T c = dot / T(d);
    T* o = dx->ptr() + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = s * (w.data[size_t(i)] * g[i] - (xr[i] * s) * c);
  }
}

template Tensor rms_norm_forward<float>(const Tensor&, const Tensor&, double, Tensor*);
template Tensor64 rms_norm_forward<double>(const Tensor64&, const Tensor64&, double, Tensor64*);
template void rms_norm_backward<float>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*);
template void rms_norm_backward<double>(const Tensor64&, const Tensor64&, const Tensor64&, const Tensor64&,
                                        Tensor64*, Tensor64*);

}  // namespace dflash::cpu
