// AdamW with fp32 (or fp64) master weights, global-norm gradient clipping and gradient accumulation,
// for the drafter trainer (docs/dflash.md "Training", step 6: AdamW, fp32 master weights,
// weight decay 0, grad clip 1.0). Semantics follow torch.optim.AdamW and
// torch.nn.utils.clip_grad_norm_, as scripts/dflash_reference.py implements them explicitly.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace dflash {

/// One named flat tensor (any shape, viewed as its numel() contiguous elements).
template <typename T>
struct NamedSpan {
  std::string name;
  std::span<T> data;
};

/// Hyper-parameters (torch.optim.AdamW defaults for betas/eps; dflash.md: lr 6e-4, weight decay 0).
struct AdamWOptions {
  double lr = 6e-4;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;          // added to sqrt(v_hat), as torch
  double weight_decay = 0.0;  // decoupled: p *= 1 - lr * wd before the Adam update
};

/// AdamW over a fixed, named list of parameters. T = float gives fp32 master weights (the
/// parameters themselves are the masters; a bf16 compute copy is made by the caller).
///
/// Step t (1-based, t = step() after the call), for every element, exactly as torch.optim.AdamW
/// (single-tensor path) and scripts/dflash_reference.py `AdamW.step`:
///   p <- p * (1 - lr * wd)
///   m <- b1 m + (1 - b1) g
///   v <- b2 v + (1 - b2) g^2
///   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
/// The scalars (bias corrections, lr / bc1, sqrt(bc2)) are computed in double and rounded to T; the
/// element math is in T.
template <typename T>
class AdamW {
 public:
  /// State for parameters named `names` with `sizes` elements each (m = v = 0, step = 0).
  AdamW(std::vector<std::string> names, std::vector<int64_t> sizes, AdamWOptions opt = {});
  /// Same, names and sizes taken from `params`.
  explicit AdamW(const std::vector<NamedSpan<T>>& params, AdamWOptions opt = {});

  /// One update of `params` with `grads` (same names, order and sizes as the constructor; throws
  /// std::invalid_argument otherwise) at learning rate `lr` (the scheduled lr; options().lr is
  /// only the default for the overload without it).
  void step(const std::vector<NamedSpan<T>>& params, const std::vector<NamedSpan<const T>>& grads, double lr);
  void step(const std::vector<NamedSpan<T>>& params, const std::vector<NamedSpan<const T>>& grads) {
    step(params, grads, opt_.lr);
  }

  const AdamWOptions& options() const { return opt_; }
  AdamWOptions& options() { return opt_; }

  // State, for the training-state file: exp_avg (m) and exp_avg_sq (v) per parameter, parallel to
  // names(), and the number of steps taken (torch's "step"). May be overwritten when resuming
  // (sizes must stay; set_state checks them).
  int64_t step_count() const { return step_; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<std::vector<T>>& exp_avg() const { return m_; }
  const std::vector<std::vector<T>>& exp_avg_sq() const { return v_; }
  /// Replaces the state (e.g. loaded from a training-state file). Throws std::invalid_argument
  /// when the number of tensors or any size differs, or step < 0.
  void set_state(int64_t step, std::vector<std::vector<T>> exp_avg, std::vector<std::vector<T>> exp_avg_sq);

 private:
  AdamWOptions opt_;
  std::vector<std::string> names_;
  std::vector<std::vector<T>> m_, v_;
  int64_t step_ = 0;
};

/// Global L2 norm over all gradients, sqrt(sum_i sum_j g_ij^2), accumulated in double (the
/// reference squares in float64; torch.nn.utils.clip_grad_norm_ with norm_type 2 is the same norm).
template <typename T>
double global_grad_norm(const std::vector<NamedSpan<const T>>& grads);

/// Result of clip_grad_norm.
struct ClipResult {
  double norm = 0;  // global norm before clipping
  double coef = 1;  // factor applied: min(1, max_norm / (norm + 1e-6))
};

/// torch.nn.utils.clip_grad_norm_(params, max_norm): norm = global_grad_norm(grads),
/// coef = min(1, max_norm / (norm + 1e-6)); every gradient is multiplied by coef (rounded to T).
/// A non-finite norm is returned as is and the gradients are left unchanged (coef reported as NaN),
/// so that the caller can skip the step.
template <typename T>
ClipResult clip_grad_norm(const std::vector<NamedSpan<T>>& grads, double max_norm);

/// Gradient accumulation over k micro-batches: acc += scale * g (element-wise, in T). Averaging k
/// micro-batch gradients = zero acc, then call with scale = 1/k for each. Throws
/// std::invalid_argument on a size mismatch.
template <typename T>
void accumulate_scaled(std::span<T> acc, std::span<const T> g, double scale);

/// Same over lists of named tensors (names and sizes must match).
template <typename T>
void accumulate_scaled(const std::vector<NamedSpan<T>>& acc, const std::vector<NamedSpan<const T>>& g, double scale);

}  // namespace dflash
