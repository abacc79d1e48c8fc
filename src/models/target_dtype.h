// How the target's linear layers compute on the GPU: `--target-dtype bf16|fp8`.
#pragma once
#include <stdexcept>
#include <string>

namespace dflash {

/// kBf16: bf16 weights and GEMM inputs (fp32 accumulation). kFp8: the projections of every layer
/// (attention q / k / v / o, GatedDeltaNet in_proj / out_proj, the dense MLP) in E4M3 with a scale
/// per output channel, quantized at load, and activations quantized per token before each product
/// (ops/cuda/fp8.h); embeddings, the LM head, MoE experts and router, norms, the GatedDeltaNet
/// recurrence, attention and the fp32 residual stream stay as in kBf16. GPU only.
enum class TargetDtype { kBf16, kFp8 };

/// "bf16" -> kBf16, "fp8" -> kFp8; std::invalid_argument naming the value otherwise.
inline TargetDtype parse_target_dtype(const std::string& s) {
  if (s == "bf16") return TargetDtype::kBf16;
  if (s == "fp8") return TargetDtype::kFp8;
  throw std::invalid_argument("--target-dtype '" + s + "': expected bf16 or fp8");
}
inline const char* target_dtype_name(TargetDtype d) { return d == TargetDtype::kFp8 ? "fp8" : "bf16"; }

}  // namespace dflash
