// Fused optimizer step on the GPU over all parameters at once (one flat fp32 buffer): global
// gradient norm, clipping and AdamW in two kernels. Reference: src/ops/cpu/optimizer.cpp (AdamW,
// clip_grad_norm = torch.optim.AdamW + torch.nn.utils.clip_grad_norm_).
#pragma once
#include <cstdint>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// Sum of g[i]^2 over n elements into *out (device double), deterministic: fixed-size per-block
/// partials in double, then one block adds them in order. `workspace` holds
/// grad_sumsq_workspace_doubles() doubles.
void grad_sumsq(const float* g, int64_t n, double* out, double* workspace, cudaStream_t stream);
int64_t grad_sumsq_workspace_doubles();

/// Scalars of one AdamW step, computed on the host as AdamW<float>::step does (double, rounded to
/// float): step_size = lr / (1 - b1^t), sqrt_bc2 = sqrt(1 - b2^t), decay = 1 - lr * wd.
struct AdamWStep {
  float b1 = 0.9f, b2 = 0.999f, one_b1 = 0.1f, one_b2 = 0.001f;
  float step_size = 0, sqrt_bc2 = 1, eps = 1e-8f, decay = 1;
  bool weight_decay = false;
};

/// Host-side scalars for step t (1-based) at learning rate lr.
AdamWStep adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t t);

/// One AdamW update of n parameters, the gradient first scaled by *grad_scale (device float: the
/// clip coefficient; pass nullptr for 1):
///   g = grad * scale; p *= decay (if wd); m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
///   p -= step_size * m / (sqrt(v) / sqrt_bc2 + eps);  p_bf16 = bf16(p) (if non-null).
void adamw_update(float* p, const float* grad, float* m, float* v, bf16* p_bf16, int64_t n, const AdamWStep& s,
                  const float* grad_scale, cudaStream_t stream);

/// *coef = min(1, max_norm / (sqrt(*sumsq) + 1e-6)) as float (torch clip_grad_norm_), or NaN when the
/// norm is not finite; *norm = sqrt(*sumsq). All device pointers.
void clip_coefficient(const double* sumsq, double max_norm, double* norm, float* coef, cudaStream_t stream);

/// x[i] *= s over n elements (fp32; averaging accumulated gradients).
void scale_inplace(float* x, float s, int64_t n, cudaStream_t stream);

}  // namespace dflash::cuda
