#include "ops/activation.h"

#include <stdexcept>

namespace dflash::cpu {

template <typename T>
void swiglu(BasicTensor<T>& gate, const BasicTensor<T>& up) {
  if (gate.shape != up.shape)
    throw std::invalid_argument("swiglu: gate " + shape_str(gate.shape) + " vs up " + shape_str(up.shape));
  for (int64_t i = 0; i < gate.numel(); ++i) gate.data[size_t(i)] = silu_t(gate.data[size_t(i)]) * up.data[size_t(i)];
}

template <typename T>
void swiglu_backward(const BasicTensor<T>& gate, const BasicTensor<T>& up, const BasicTensor<T>& dy,
                     OutTensor<T>* dgate, OutTensor<T>* dup) {
  if (gate.shape != up.shape || dy.shape != gate.shape)
    throw std::invalid_argument("swiglu_backward: gate " + shape_str(gate.shape) + ", up " + shape_str(up.shape) +
                                ", dy " + shape_str(dy.shape));
  if (dgate) *dgate = BasicTensor<T>(gate.shape);
  if (dup) *dup = BasicTensor<T>(gate.shape);
  for (size_t i = 0; i < gate.data.size(); ++i) {
    const T g = gate.data[i], s = sigmoid_t(g);
    if (dgate) dgate->data[i] = dy.data[i] * up.data[i] * s * (T(1) + g * (T(1) - s));
    if (dup) dup->data[i] = dy.data[i] * g * s;
  }
}

template void swiglu<float>(Tensor&, const Tensor&);
template void swiglu<double>(Tensor64&, const Tensor64&);
template void swiglu_backward<float>(const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*);
template void swiglu_backward<double>(const Tensor64&, const Tensor64&, const Tensor64&, Tensor64*, Tensor64*);

}  // namespace dflash::cpu
