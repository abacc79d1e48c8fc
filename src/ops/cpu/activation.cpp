#include "ops/activation.h"

#include <stdexcept>

namespace dflash::cpu {

void swiglu(Tensor& gate, const Tensor& up) {
  if (gate.shape != up.shape)
    throw std::invalid_argument("swiglu: gate " + shape_str(gate.shape) + " vs up " + shape_str(up.shape));
  for (int64_t i = 0; i < gate.numel(); ++i) gate.data[i] = silu(gate.data[i]) * up.data[i];
}

}  // namespace dflash::cpu
