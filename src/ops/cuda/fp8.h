// FP8 (E4M3) quantization of the target's GEMM operands (`--target-dtype fp8`): one kernel gives the
// weights their per-output-channel scales at load and the activations their dynamic per-token
// scales before each product (the rowwise recipe of torch._scaled_mm and vLLM's
// per-token x per-channel FP8 linear). CPU reference: f32_to_fp8_e4m3 (src/tensor/dtype.h).
#pragma once
#include <cstdint>
#include <string>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// Per-row symmetric quantization of x [rows, cols] (bf16): scale[r] = max(max_c |x[r, c]| / 448,
/// 1e-30) (1 for a row of zeros), q[r, c] = E4M3(x[r, c] * (1 / scale[r])) rounded to nearest even and
/// saturated, so that x ~ q * scale. An infinite element makes its row's scale NaN, a NaN element
/// stays NaN in q: either propagates to the product, where the target's checks see it. An nn.Linear weight [N, K] gets one scale per output channel; the
/// activations [T, K] one per token. q [rows, cols] fp8, scale [rows] fp32. Throws
/// std::invalid_argument on negative sizes.
void quantize_rows_fp8(const bf16* x, int64_t rows, int64_t cols, fp8* q, float* scale, cudaStream_t stream);

/// y [rows, cols] = q * scale[r] (bf16, rounded once): the weights an FP8 target computes with, for
/// tests and comparisons against the bf16 path.
void dequantize_rows_fp8(const fp8* q, const float* scale, int64_t rows, int64_t cols, bf16* y, cudaStream_t stream);

/// Why the current device cannot run the FP8 target path ("" when it can): compute capability below
/// 8.9 (no FP8 tensor cores: Ada and Hopper have them), or this cuBLASLt has no per-row / per-column
/// scaled E4M3 product on it (probed once per device with a small product). Never throws: a CUDA
/// error becomes the reason.
std::string fp8_unsupported_reason();

}  // namespace dflash::cuda
