// Linear layer (no bias): y = x @ W^T, as torch.nn.functional.linear, and its backward.
#pragma once
#include "tensor/tensor.h"

namespace dflash::cpu {

/// y [T, out] = x [T, in] @ w[out, in]^T (x may have any leading dims [..., in]). T = float (OpenBLAS
/// sgemm, fp32 accumulate) or double (dgemm). Throws std::invalid_argument when shapes disagree
/// (message names `what`).
template <typename T>
BasicTensor<T> linear(const BasicTensor<T>& x, const BasicTensor<T>& w, const char* what = "linear");

/// Backward of y = x @ w^T, with x [N, in] (any leading dims [..., in]), w [out, in], dy [N, out]:
///   dx [N, in] = dy @ w              (if dx; overwritten and reshaped to x.shape)
///   dw [out, in] += dy^T @ x          (if dw; accumulated; an empty dw is first set to zeros [out, in])
/// The forward saves nothing beyond its inputs x and w. Throws std::invalid_argument on shapes.
template <typename T>
void linear_backward(const BasicTensor<T>& x, const BasicTensor<T>& w, const BasicTensor<T>& dy,
                     OutTensor<T>* dx, OutTensor<T>* dw, const char* what = "linear_backward");

/// Gathers rows: out [T, D] = table [V, D][ids]. Throws std::out_of_range for ids outside [0, V).
Tensor embedding(const Tensor& table, const std::vector<int32_t>& ids);

}  // namespace dflash::cpu
