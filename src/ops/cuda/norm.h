// RMSNorm on the GPU, forward and backward (reference: src/ops/cpu/norm.cpp rms_norm_forward /
// rms_norm_backward; math as transformers' Qwen3RMSNorm, and Qwen3_5RMSNorm for zero_centered).
#pragma once
#include <cstdint>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// x [rows, n] bf16 -> y [rows, n] bf16, per row in fp32:
///   inv = rsqrt(mean(x^2) + eps);  y = g * (x * inv),  g = w (plain) or 1 + w (zero_centered).
/// w [n] fp32. Saves inv [rows] fp32 for the backward when non-null. y may alias x.
void rms_norm_forward(const bf16* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, double eps,
                      bool zero_centered, cudaStream_t stream);

/// The same with an fp32 input (a residual stream kept in fp32), y bf16.
void rms_norm_forward(const float* x, const float* w, bf16* y, float* inv, int64_t rows, int64_t n, double eps,
                      bool zero_centered, cudaStream_t stream);

/// Backward of rms_norm_forward with the saved inv:
///   xh = x * inv;  dx = inv * (g*dy - xh * mean(g*dy*xh))  (bf16, may alias dy);
///   dw += sum over rows of dy * xh  (fp32, accumulated into dw; deterministic: fixed-order
///   partial sums in `workspace`, which holds rms_norm_workspace_floats(rows, n) floats).
/// dx may be null (only dw wanted) and dw may be null (a norm without learned weight).
void rms_norm_backward(const bf16* x, const float* w, const float* inv, const bf16* dy, bf16* dx, float* dw,
                       float* workspace, int64_t rows, int64_t n, bool zero_centered, cudaStream_t stream);
/// Size of rms_norm_backward's workspace, in floats.
int64_t rms_norm_workspace_floats(int64_t rows, int64_t n);

}  // namespace dflash::cuda
