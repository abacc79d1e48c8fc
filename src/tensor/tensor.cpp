#include "tensor/tensor.h"

namespace dflash {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

Tensor slice_rows(const Tensor& t, int64_t b, int64_t e) {
  if (t.ndim() == 0 || b < 0 || e < b || e > t.dim(0))
    throw std::out_of_range("slice_rows: rows [" + std::to_string(b) + ", " + std::to_string(e) + ") of " +
                            shape_str(t.shape));
  const int64_t inner = t.dim(0) ? t.numel() / t.dim(0) : 0;
  Tensor r;
  r.shape = t.shape;
  r.shape[0] = e - b;
  r.data.assign(t.data.begin() + b * inner, t.data.begin() + e * inner);
  return r;
}

}  // namespace dflash
