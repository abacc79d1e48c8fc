// Elementwise activations used by the targets.
#pragma once
#include <cmath>

#include "tensor/tensor.h"

namespace dflash::cpu {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
/// torch.nn.functional.softplus with beta 1, threshold 20.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

/// silu / sigmoid in the precision of T (float or double), for the templated ops.
template <typename T>
inline T silu_t(T x) { return x / (T(1) + std::exp(-x)); }
template <typename T>
inline T sigmoid_t(T x) { return T(1) / (T(1) + std::exp(-x)); }

/// SwiGLU in place: gate <- silu(gate) * up. Shapes must match ([T, I]). T = float or double.
template <typename T>
void swiglu(BasicTensor<T>& gate, const BasicTensor<T>& up);

/// Backward of y = silu(gate) * up (gate, up, dy [T, I]; the forward saves its inputs gate and up):
///   dgate = dy * up * s * (1 + gate * (1 - s)),  s = sigmoid(gate)
///   dup   = dy * silu(gate)
/// Both outputs are overwritten (shape of gate); either may be null.
template <typename T>
void swiglu_backward(const BasicTensor<T>& gate, const BasicTensor<T>& up, const BasicTensor<T>& dy,
                     OutTensor<T>* dgate, OutTensor<T>* dup);

}  // namespace dflash::cpu
