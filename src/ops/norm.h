// RMSNorm variants (transformers: LlamaRMSNorm, Qwen3_5RMSNorm, Qwen3_5RMSNormGated) and l2norm.
#pragma once
#include <cstdint>

#include "tensor/tensor.h"

namespace dflash::cpu {

/// In place over the last dim of x, which must have size d = w.numel():
/// plain (Llama/Qwen3):       y = w * x / sqrt(mean(x^2) + eps)
/// zero_centered (Qwen3.5):   y = (1 + w) * x / sqrt(mean(x^2) + eps)
/// w has shape [d]. Computed in fp32 (float accumulation in double for the mean).
void rms_norm(Tensor& x, const Tensor& w, double eps, bool zero_centered);

/// Qwen3.5 GatedDeltaNet output norm, in place over rows of size d = w.numel():
/// y = w * rmsnorm(x) * silu(z). x and z have the same shape [..., d].
void gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, double eps);

/// In place over rows of size d: x / sqrt(sum(x^2) + eps) (fla / transformers l2norm, eps 1e-6).
void l2_norm(float* x, int64_t rows, int64_t d, double eps = 1e-6);

/// Training forward of the plain RMSNorm (Llama / Qwen3, the drafter's norms and q_norm / k_norm):
/// y = w * x * r with r = 1 / sqrt(mean(x^2) + eps) per row of size d. x [..., d], w [d] -> y [..., d].
/// Saves for the backward: inv_rms [rows] = r per row (rows = x.numel() / d), written if non-null.
/// T = float or double (the mean is accumulated in double for both).
template <typename T>
BasicTensor<T> rms_norm_forward(const BasicTensor<T>& x, const BasicTensor<T>& w, double eps,
                                OutTensor<T>* inv_rms);

/// Backward of rms_norm_forward, with x_hat = x * r (r = the saved inv_rms):
///   dx = r * (w * dy - x_hat * mean_i(w_i * dy_i * x_hat_i))   (if dx; overwritten, x.shape)
///   dw += sum over rows of dy * x_hat                          (if dw; accumulated, empty -> zeros [d])
template <typename T>
void rms_norm_backward(const BasicTensor<T>& x, const BasicTensor<T>& w, const BasicTensor<T>& inv_rms,
                       const BasicTensor<T>& dy, OutTensor<T>* dx, OutTensor<T>* dw);

}  // namespace dflash::cpu
