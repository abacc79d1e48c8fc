#include "ops/optimizer.h"

#include <cmath>
#include <stdexcept>

namespace dflash {

namespace {

template <typename A, typename B>
void check_same(const std::vector<NamedSpan<A>>& a, const std::vector<NamedSpan<B>>& b, const char* what) {
  if (a.size() != b.size())
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(a.size()) + " vs " +
                                std::to_string(b.size()) + " tensors");
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].name != b[i].name || a[i].data.size() != b[i].data.size())
      throw std::invalid_argument(std::string(what) + ": tensor " + std::to_string(i) + " is " + a[i].name + " (" +
                                  std::to_string(a[i].data.size()) + ") vs " + b[i].name + " (" +
                                  std::to_string(b[i].data.size()) + ")");
}

}  // namespace

template <typename T>
AdamW<T>::AdamW(std::vector<std::string> names, std::vector<int64_t> sizes, AdamWOptions opt)
    : opt_(opt), names_(std::move(names)) {
  if (names_.size() != sizes.size()) throw std::invalid_argument("AdamW: names and sizes differ in length");
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) throw std::invalid_argument("AdamW: negative size for " + names_[i]);
    m_.emplace_back(size_t(sizes[i]), T(0));
    v_.emplace_back(size_t(sizes[i]), T(0));
  }
}

template <typename T>
AdamW<T>::AdamW(const std::vector<NamedSpan<T>>& params, AdamWOptions opt) : opt_(opt) {
  for (const auto& p : params) {
    names_.push_back(p.name);
    m_.emplace_back(p.data.size(), T(0));
    v_.emplace_back(p.data.size(), T(0));
  }
}

template <typename T>
void AdamW<T>::step(const std::vector<NamedSpan<T>>& params, const std::vector<NamedSpan<const T>>& grads, double lr) {
  check_same(params, grads, "AdamW::step params vs grads");
  if (params.size() != names_.size()) throw std::invalid_argument("AdamW::step: parameter count differs from the state");
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].name != names_[i] || params[i].data.size() != m_[i].size())
      throw std::invalid_argument("AdamW::step: parameter " + std::to_string(i) + " " + params[i].name +
                                  " does not match the state's " + names_[i]);
  ++step_;
  const double t = double(step_);
  const double bc1 = 1.0 - std::pow(opt_.beta1, t), bc2 = 1.0 - std::pow(opt_.beta2, t);
  const T decay = T(1.0 - lr * opt_.weight_decay);
  const T b1 = T(opt_.beta1), b2 = T(opt_.beta2), one_b1 = T(1.0 - opt_.beta1), one_b2 = T(1.0 - opt_.beta2);
  const T step_size = T(lr / bc1), sqrt_bc2 = T(std::sqrt(bc2)), eps = T(opt_.eps);
  const bool wd = opt_.weight_decay != 0.0;
  for (size_t i = 0; i < params.size(); ++i) {
    T* p = params[i].data.data();
    const T* g = grads[i].data.data();
    T* m = m_[i].data();
    T* v = v_[i].data();
    const size_t n = m_[i].size();
    for (size_t j = 0; j < n; ++j) {
      if (wd) p[j] *= decay;
      m[j] = m[j] * b1 + one_b1 * g[j];
      v[j] = v[j] * b2 + one_b2 * (g[j] * g[j]);
      const T denom = std::sqrt(v[j]) / sqrt_bc2 + eps;
      p[j] -= step_size * (m[j] / denom);
    }
  }
}

template <typename T>
void AdamW<T>::set_state(int64_t step, std::vector<std::vector<T>> exp_avg, std::vector<std::vector<T>> exp_avg_sq) {
  if (step < 0) throw std::invalid_argument("AdamW::set_state: negative step");
  if (exp_avg.size() != m_.size() || exp_avg_sq.size() != v_.size())
    throw std::invalid_argument("AdamW::set_state: tensor count differs");
  for (size_t i = 0; i < m_.size(); ++i)
    if (exp_avg[i].size() != m_[i].size() || exp_avg_sq[i].size() != v_[i].size())
      throw std::invalid_argument("AdamW::set_state: size of " + names_[i] + " differs");
  step_ = step;
  m_ = std::move(exp_avg);
  v_ = std::move(exp_avg_sq);
}

template <typename T>
double global_grad_norm(const std::vector<NamedSpan<const T>>& grads) {
  double s = 0;
  for (const auto& g : grads)
    for (T x : g.data) s += double(x) * double(x);
  return std::sqrt(s);
}

template <typename T>
ClipResult clip_grad_norm(const std::vector<NamedSpan<T>>& grads, double max_norm) {
  std::vector<NamedSpan<const T>> c;
  c.reserve(grads.size());
  for (const auto& g : grads) c.push_back({g.name, std::span<const T>(g.data)});
  ClipResult r;
  r.norm = global_grad_norm(c);
  if (!std::isfinite(r.norm)) {
    r.coef = std::nan("");
    return r;
  }
  r.coef = std::min(1.0, max_norm / (r.norm + 1e-6));
  const T coef = T(r.coef);
  for (const auto& g : grads)
    for (T& x : g.data) x *= coef;
  return r;
}

template <typename T>
void accumulate_scaled(std::span<T> acc, std::span<const T> g, double scale) {
  if (acc.size() != g.size())
    throw std::invalid_argument("accumulate_scaled: " + std::to_string(acc.size()) + " vs " + std::to_string(g.size()));
  const T s = T(scale);
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += s * g[i];
}

template <typename T>
void accumulate_scaled(const std::vector<NamedSpan<T>>& acc, const std::vector<NamedSpan<const T>>& g, double scale) {
  check_same(acc, g, "accumulate_scaled");
  for (size_t i = 0; i < acc.size(); ++i) accumulate_scaled(acc[i].data, g[i].data, scale);
}

#define DFLASH_INST(T)                                                                                   \
  template class AdamW<T>;                                                                               \
  template double global_grad_norm<T>(const std::vector<NamedSpan<const T>>&);                          \
  template ClipResult clip_grad_norm<T>(const std::vector<NamedSpan<T>>&, double);                      \
  template void accumulate_scaled<T>(std::span<T>, std::span<const T>, double);                         \
  template void accumulate_scaled<T>(const std::vector<NamedSpan<T>>&, const std::vector<NamedSpan<const T>>&, \
                                     double);
DFLASH_INST(float)
DFLASH_INST(double)
#undef DFLASH_INST

}  // namespace dflash
