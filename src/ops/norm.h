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

}  // namespace dflash::cpu
