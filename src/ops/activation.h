// Elementwise activations used by the targets.
#pragma once
#include <cmath>

#include "tensor/tensor.h"

namespace dflash::cpu {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
/// torch.nn.functional.softplus with beta 1, threshold 20.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

/// SwiGLU in place: gate <- silu(gate) * up. Shapes must match ([T, I]).
void swiglu(Tensor& gate, const Tensor& up);

}  // namespace dflash::cpu
