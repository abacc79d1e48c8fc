// Linear layer (no bias): y = x @ W^T, as torch.nn.functional.linear.
#pragma once
#include "tensor/tensor.h"

namespace dflash::cpu {

/// y [T, out] = x [T, in] @ w[out, in]^T. float32, OpenBLAS sgemm (fp32 accumulate).
/// Throws std::invalid_argument when shapes disagree (message names `what`).
Tensor linear(const Tensor& x, const Tensor& w, const char* what = "linear");

/// Gathers rows: out [T, D] = table [V, D][ids]. Throws std::out_of_range for ids outside [0, V).
Tensor embedding(const Tensor& table, const std::vector<int32_t>& ids);

}  // namespace dflash::cpu
