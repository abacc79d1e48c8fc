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

}  // namespace dflash::cpu
