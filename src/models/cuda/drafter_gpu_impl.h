// DrafterGpu's state, shared by its parameters and optimizer (drafter_gpu.cpp), its training step
// (drafter_gpu_step.cpp), its drafting (drafter_gpu_draft.cpp) and DSpark's loss (drafter_gpu_dspark.cpp).
// Internal to src/models/cuda.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "models/cuda/drafter_gpu.h"
#include "models/cuda/kv_cache.h"
#include "ops/cuda/gemm.h"

namespace dflash {

/// Flat offsets (elements) of draft layer i's parameters ("layers.<i>.<name>") in DrafterGpu's
/// master, gradient and bf16 buffers.
struct LayerParams {
  int64_t input_layernorm = -1, q_proj = -1, k_proj = -1, v_proj = -1, o_proj = -1, q_norm = -1, k_norm = -1;
  int64_t post_attention_layernorm = -1, down_proj = -1;
  int64_t gate_up = -1;  // mlp.gate_proj, which mlp.up_proj follows: both as one [2 I, d] matrix whose
                         // product's output rows are gate | up (cuda::swiglu_forward's layout)
  int64_t up_proj = -1;  // = gate_up + I d (checked at allocation)
};

/// Every parameter's flat offset (drafter_param_shapes' names), looked up once at allocation; -1 for
/// what the drafter has not (DSpark's heads in a DFlash drafter). Throws std::logic_error (from()) when
/// a name is missing or up_proj does not follow gate_proj.
struct ParamOffsets {
  int64_t fc = -1, hidden_norm = -1, norm = -1;
  int64_t markov_w1 = -1, markov_w2 = -1, confidence_w = -1, confidence_b = -1;  // DSpark
  std::vector<LayerParams> layers;
  const LayerParams& layer(int64_t i) const { return layers.at(size_t(i)); }
  static ParamOffsets from(const std::map<std::string, int64_t>& offset, const DrafterConfig& c);
};

/// The cuBLASLt workspace of a DrafterGpu's GemmContext.
inline constexpr size_t kDrafterGemmWorkspaceBytes = size_t(32) << 20;

struct DrafterGpu::Impl {
  cudaStream_t s;
  cuda::GemmContext gemm;
  int64_t n = 0;                                  // parameters
  cuda::DeviceArray<float> master, grad, m, v;    // flat fp32 [n]
  // zero_grads() was called and no gradient has been written since: `grad` holds stale values that
  // count as zero. The next backward overwrites every gradient (beta 0 GEMMs; the norm weights'
  // gradients zeroed first); whatever reads `grad` before that zeroes it (grad_buffer()).
  bool grad_zero_pending = false;
  cuda::DeviceArray<cuda::bf16> wb;               // flat bf16 copy [n]
  std::map<std::string, int64_t> offset;          // parameter name -> flat offset
  ParamOffsets p;                                 // the same offsets, typed
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  cuda::DeviceArray<cuda::bf16> embed, lm_head;   // [V, d]
  int64_t V = 0;
  cuda::DeviceArray<double> sumsq, norm, sumsq_ws;
  cuda::DeviceArray<float> coef;
  cuda::DeviceArray<double> inv_freq;             // RoPE [head_dim / 2], computed in double as the reference
  double rope_scale = 1.0;                        // cos / sin factor (yarn's attention factor)
  KvCache ctx;                                    // drafting: each layer's context keys / values per sequence

  explicit Impl(cudaStream_t st) : s(st), gemm(st, kDrafterGemmWorkspaceBytes) {}
  // A parameter's values: by its flat offset (ParamOffsets, below).
  const cuda::bf16* W(int64_t offset) const { return wb.data() + offset; }
  const float* F(int64_t offset) const { return master.data() + offset; }
  float* G(int64_t offset) { return grad.data() + offset; }
  /// The gradient buffer, zeroed first if a zero_grads() is pending.
  float* grad_buffer() {
    if (grad_zero_pending) grad.fill_bytes(0, s);
    grad_zero_pending = false;
    return grad.data();
  }
};

// DSpark's loss in the training step (drafter_gpu_dspark.cpp; reference: dspark_loss, src/models/dspark.h).
/// Rows per chunk of DSpark's loss for `rows` rows: z and t (fp32) and dz (bf16), 10 V bytes a row,
/// within max_bytes (at least 16 rows).
int64_t dspark_loss_row_chunk(int64_t V, int64_t rows, int64_t max_bytes);
/// Device bytes dspark_step_loss allocates for `rows` rows in chunks of `row_chunk`.
int64_t dspark_loss_workspace_bytes(const DrafterConfig& c, int64_t V, int64_t rows, int64_t row_chunk);
/// DSpark's loss over the `rows` rows with a weight: hf [rows, d] their final hidden states, target_hidden
/// [S, d] the target's (device bf16), and per row its label, previous token, target row (into
/// target_hidden) and coef = w / sum w. Fills row_loss (0.1 CE + 0.9 L1 + BCE, unweighted) and the
/// argmax of the corrected logits; with dhf, writes d loss / d hf [rows, d] and the heads' gradients:
/// markov_w2 by GEMM (beta w2_beta), markov_w1 and the confidence head by atomics (added: the
/// caller zeroes them after zero_grads). Synchronizes the stream (the row statistics come back).
void dspark_step_loss(DrafterGpu::Impl& I, const DrafterConfig& c, const cuda::bf16* hf, int64_t rows,
                      const cuda::bf16* target_hidden, int64_t S, const std::vector<int32_t>& labels,
                      const std::vector<int32_t>& prev, const std::vector<int32_t>& target_row,
                      const std::vector<float>& coef, int64_t row_chunk, cuda::bf16* dhf, float w2_beta,
                      std::vector<double>* row_loss, std::vector<int32_t>* argmax);

}  // namespace dflash
