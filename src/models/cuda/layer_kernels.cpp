// The GPU half of layer_kernels (models/target.h): what TargetGpu runs a layer with.
#include "gpu/device_info.h"
#include "models/target.h"
#include "ops/cuda/masked_attention.h"

namespace dflash {

KernelChoice gpu_layer_kernel(const ModelSpec& s, int64_t layer, TargetDtype dtype) {
  const LayerKind kind = s.layer_types.at(size_t(layer));
  const bool moe = s.is_moe_layer(layer);
  const std::string why = gpu_unsupported_reason(s);
  if (!why.empty()) return {"cuda", "", why};  // no fallback is offered
  const std::string gemms = dtype == TargetDtype::kFp8
                                ? "cuBLASLt FP8 E4M3 GEMMs (weights: a scale per output channel; activations: a "
                                  "scale per token, quantized before each product)"
                                : "cuBLASLt bf16 GEMMs";
  return {"cuda",
          (kind == LayerKind::Attention
               ? "cuda::masked_attention_forward<head_dim " + std::to_string(s.head_dim) + "> (causal varlen, " +
                     (cuda::masked_attention_uses_wgmma(int(s.head_dim)) ? "wgmma (sm_90a)" : "mma.sync") +
                     " bf16, fp32 softmax)" + (s.attn_output_gate() ? " + sigmoid output gate" : "") + " + " + gemms
               : gemms + std::string(" (in_proj_qkv|z|b|a as one) + gated_delta_rule_chunked "
                                     "(chunk 64, WY/UT form, fp32 state; conv1d + SiLU, q/k l2norm and gates in its "
                                     "chunk_prepare, cuda::causal_conv1d_silu with a decoding cache; chunk_state on " +
                                     std::string(cuda::runs_sm90a() ? "wgmma (sm_90a) at 64 state columns a block, else "
                                                                    : "") +
                                     "mma.sync, 3xBF16; on sm_90+ chunk_state beside chunk_prepare and chunk_out beside "
                                     "chunk_state; the gated RMSNorm fused into its output)")) +
              (moe ? "; experts: cuda::moe_route (on-device top-k) + grouped_gemm (mma.sync bf16, no host sync)"
                   : "; MLP: " + gemms),
          ""};
}

}  // namespace dflash
