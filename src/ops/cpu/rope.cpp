#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

namespace dflash::cpu {

template <typename T>
std::vector<T> rope_frequencies(const RopeSpec& rope, int64_t rotary_dim) {
  if (rotary_dim <= 0 || rotary_dim % 2 != 0)
    throw std::invalid_argument("rope: rotary_dim " + std::to_string(rotary_dim) + " must be even and positive");
  const int64_t half = rotary_dim / 2;
  std::vector<T> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    // torch: 1.0 / (base ** (arange(0, dim, 2, dtype=int64).float() / dim)), in float32.
    const T expo = T(2 * i) / T(rotary_dim);
    inv[size_t(i)] = T(1) / std::pow(T(rope.theta), expo);
  }
  if (rope.type == "default") return inv;
  if (rope.type == "llama3") {
    // transformers _compute_llama3_parameters
    const double low_wavelen = double(rope.original_max_position_embeddings) / rope.low_freq_factor;
    const double high_wavelen = double(rope.original_max_position_embeddings) / rope.high_freq_factor;
    for (auto& f : inv) {
      const double wavelen = 2 * std::numbers::pi / double(f);
      if (wavelen > low_wavelen) {
        f = T(double(f) / rope.factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth = (double(rope.original_max_position_embeddings) / wavelen - rope.low_freq_factor) /
                              (rope.high_freq_factor - rope.low_freq_factor);
        f = T((1 - smooth) * double(f) / rope.factor + smooth * double(f));
      }
    }
    return inv;
  }
  if (rope.type == "yarn") {
    // transformers _compute_yarn_parameters: dims whose wavelength rotates fewer than beta_slow times
    // over the pretrained context are interpolated (divided by factor), more than beta_fast times kept,
    // a linear ramp between.
    const double dim = double(rotary_dim), base = rope.theta, ctx = double(rope.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return dim * std::log(ctx / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
    };
    double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
    if (rope.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0), high = std::min(high, dim - 1);
    if (low == high) high += 0.001;  // no zero-width ramp
    for (int64_t i = 0; i < half; ++i) {  // in T: float as torch's float32 blend
      const T pos = std::pow(T(base), T(2 * i) / T(rotary_dim)), extrapolated = T(1) / pos;
      const T interpolated = T(1) / (T(rope.factor) * pos);
      const T ramp = std::clamp((T(i) - T(low)) / (T(high) - T(low)), T(0), T(1)), keep = T(1) - ramp;
      inv[size_t(i)] = interpolated * (T(1) - keep) + extrapolated * keep;
    }
    return inv;
  }
  throw std::invalid_argument("rope: unsupported rope_type '" + rope.type + "' (supported: default, llama3, yarn)");
}
template std::vector<float> rope_frequencies<float>(const RopeSpec&, int64_t);
template std::vector<double> rope_frequencies<double>(const RopeSpec&, int64_t);

std::vector<float> rope_inv_freq(const RopeSpec& rope, int64_t rotary_dim) {
  return rope_frequencies<float>(rope, rotary_dim);
}

double rope_attention_factor(const RopeSpec& rope) {
  if (rope.type != "yarn") return 1.0;
  if (rope.attention_factor > 0) return rope.attention_factor;
  auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  if (rope.mscale != 0 && rope.mscale_all_dim != 0)
    return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim);
  return mscale(rope.factor, 1.0);
}

namespace {
template <typename T>
void rotate(BasicTensor<T>& x, const std::vector<int64_t>& positions, const std::vector<float>& inv_freq,
            int64_t rotary_dim, T sign, const char* what) {
  if (x.ndim() != 3 || x.dim(0) != int64_t(positions.size()) || rotary_dim > x.dim(2) ||
      int64_t(inv_freq.size()) * 2 != rotary_dim)
    throw std::invalid_argument(std::string(what) + ": x " + shape_str(x.shape) + ", " +
                                std::to_string(positions.size()) + " positions, rotary_dim " +
                                std::to_string(rotary_dim));
  const int64_t n = x.dim(0), H = x.dim(1), D = x.dim(2), half = rotary_dim / 2;
  std::vector<T> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      // float: fp32 product as torch; double: exact product of the same fp32 frequency.
      const T ang = T(positions[size_t(t)]) * T(inv_freq[size_t(i)]);
      c[size_t(i)] = std::cos(ang);
      s[size_t(i)] = sign * std::sin(ang);
    }
    for (int64_t h = 0; h < H; ++h) {
      T* p = x.ptr() + (t * H + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const T a = p[i], b = p[i + half];
        p[i] = a * c[size_t(i)] - b * s[size_t(i)];
        p[i + half] = b * c[size_t(i)] + a * s[size_t(i)];
      }
    }
  }
}
}  // namespace

template <typename T>
void apply_rope(BasicTensor<T>& x, const std::vector<int64_t>& positions, const std::vector<float>& inv_freq,
                int64_t rotary_dim) {
  rotate(x, positions, inv_freq, rotary_dim, T(1), "apply_rope");
}

template <typename T>
void apply_rope_backward(BasicTensor<T>& dy, const std::vector<int64_t>& positions,
                         const std::vector<float>& inv_freq, int64_t rotary_dim) {
  rotate(dy, positions, inv_freq, rotary_dim, T(-1), "apply_rope_backward");
}

template void apply_rope<float>(Tensor&, const std::vector<int64_t>&, const std::vector<float>&, int64_t);
template void apply_rope<double>(Tensor64&, const std::vector<int64_t>&, const std::vector<float>&, int64_t);
template void apply_rope_backward<float>(Tensor&, const std::vector<int64_t>&, const std::vector<float>&, int64_t);
template void apply_rope_backward<double>(Tensor64&, const std::vector<int64_t>&, const std::vector<float>&,
                                          int64_t);

}  // namespace dflash::cpu
