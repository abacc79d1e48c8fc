// The DFlash drafter on one GPU: forward + backward of a training sequence and the fused optimizer
// step, in bf16 compute with fp32 master weights, gradients and AdamW moments. The same math as the
// CPU reference drafter_step (src/models/drafter.h) and AdamW / clip_grad_norm (src/ops/optimizer.h),
// built from the kernels in src/ops/cuda.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/runtime.h"
#include "models/drafter.h"
#include "ops/optimizer.h"

namespace dflash {
namespace cuda {
class GemmContext;
}

/// One training sequence for the GPU step. Anchors and blocks as DrafterSequence.
struct DrafterGpuSequence {
  const cuda::bf16* taps = nullptr;  // device [S, K*d], target taps concatenated in target_layer_ids order
  std::vector<int64_t> ids;          // [S]
  std::vector<int64_t> loss_mask;    // [S] (0/1)
  std::vector<int64_t> anchors;      // sorted valid anchors
  int64_t num_blocks = 0;            // >= anchors.size(); the rest are padding blocks
  double gamma = 7.0;
  bool dpace = false;  // D-PACE weights instead of the gamma decay (dpace_weights, src/models/drafter.h)
  /// DSpark only: device [S, d] bf16, the target's final hidden states (after its final norm).
  const cuda::bf16* target_hidden = nullptr;
};

struct DrafterGpuStepOptions {
  bool backward = true;
  int64_t ce_chunk_bytes = int64_t(1) << 30;  // fp32 logits held at once by the cross entropy (rows x V x 4)
  bool time_stages = false;  // fill DrafterGpuStepResult::stage_ms (CUDA events around each stage)
  /// Activation recomputation: keep only each layer's input through the forward and run the layer
  /// again in the backward (about one more forward of the layers; saves their activations).
  bool recompute = false;
};

struct DrafterGpuStepResult {
  double loss = 0, weight_sum = 0;                    // as DrafterStepResult
  std::vector<int64_t> slot_correct, slot_count;      // [B]
  /// With time_stages: milliseconds per stage, GPU time, summed over layers: "forward" and
  /// "backward" (whole passes, cross entropy excluded), "attention_fwd", "attention_bwd" (inside
  /// them), "cross_entropy" (fused forward + backward).
  std::vector<std::pair<std::string, double>> stage_ms;
  bool nonfinite_taps = false;  // the taps held NaN / Inf (the loss and gradients are then meaningless)
};

/// Parameters of a drafter on the GPU (order and names: DrafterWeights::named()) and the frozen
/// target embed_tokens / lm_head (bf16). All work runs on `stream`; not thread-safe (one per
/// training thread). Needs head_dim 64 or 128 (the attention kernels' backward).
class DrafterGpu {
 public:
  /// Uploads `w` (fp32 masters, bf16 copy), embed and lm_head [V, d] (rounded to bf16). Zero
  /// gradients and moments. Throws std::invalid_argument on shapes, std::runtime_error on CUDA errors.
  DrafterGpu(const DrafterConfig& cfg, const DrafterWeights<float>& w, const Tensor& embed, const Tensor& lm_head,
             cudaStream_t stream);
  /// Random drafter and target tensors made on the device (benchmarks): projections and fc
  /// ~ N(0, 0.02^2), norm weights 1, embed / lm_head [V, d] ~ N(0, 0.02^2), from `seed`.
  DrafterGpu(const DrafterConfig& cfg, int64_t V, uint64_t seed, cudaStream_t stream);
  ~DrafterGpu();

  /// Forward (and backward) of one sequence, as drafter_step. The gradients are ADDED to the
  /// gradient buffer (zero_grads() starts a step; several calls accumulate micro-batches).
  /// Synchronizes the stream once (the loss is read back). Throws std::invalid_argument on bad input.
  DrafterGpuStepResult step(const DrafterGpuSequence& seq, const DrafterGpuStepOptions& opt = {});

  /// Starts a gradient sum: the next step's backward overwrites every gradient (no memset of the
  /// buffer; anything that reads it first sees zeros).
  void zero_grads();
  /// Multiplies every gradient by `s` (averaging over micro-batches).
  void scale_grads(float s);
  /// clip_grad_norm(max_norm) then AdamW step t (1-based) at lr, fused over all parameters; skips
  /// the update (and reports it) when the norm is not finite. Synchronizes (returns the norm).
  ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t);

  DrafterWeights<float> weights() const;  // fp32 masters, downloaded
  DrafterWeights<float> grads() const;    // fp32 gradients, downloaded
  /// AdamW moments (exp_avg, exp_avg_sq), downloaded, one vector per parameter in named() order.
  void moments(std::vector<std::vector<float>>* exp_avg, std::vector<std::vector<float>>* exp_avg_sq) const;
  /// Replaces masters (and their bf16 copy) and moments (resume). Throws std::invalid_argument on sizes.
  void set_state(const DrafterWeights<float>& w, const std::vector<std::vector<float>>& exp_avg,
                 const std::vector<std::vector<float>>& exp_avg_sq);
  // Drafting (src/spec/decoder.h; docs/dflash.md "Serving loop"): for each of n sequences
  // a device cache of every draft layer's context keys (k_proj, k_norm, RoPE at their positions) and
  // values, as the CPU DrafterContextCache (src/models/drafter.h), so a draft projects only its block.
  /// Drops any earlier context cache and starts n empty sequences.
  void reset_context(int n);
  /// Appends context rows: sequence q gets rows cu[q] .. cu[q + 1] - 1 of taps [T, K*d] (device bf16,
  /// target taps in target_layer_ids order) at positions context_length(q) onwards; cu [n + 1].
  /// Throws std::invalid_argument for a bad cu, std::runtime_error when the cache cannot grow.
  void extend_context(const cuda::bf16* taps, const std::vector<int64_t>& cu);
  /// Keeps the first `length` context rows of sequence q (0 clears it).
  void truncate_context(int q, int64_t length);
  int64_t context_length(int q) const;
  /// Greedy drafts, one forward for all sequences: for each q with last[q] >= 0 the block
  /// [last[q], MASK x (B-1)] at positions context_length(q) .. + B - 1 (as drafter_draft_logits);
  /// returns the argmax tokens of slots 1 .. B-1 (DSpark: of slots 0 .. B-1 along its Markov walk,
  /// as dspark_greedy_drafts), nothing for last[q] < 0. last [n]. Throws
  /// std::invalid_argument for a token outside the vocabulary or a wrong number of sequences.
  std::vector<std::vector<int32_t>> draft(const std::vector<int32_t>& last);

  /// Device bytes the constructors allocate for `cfg` and a vocabulary of V: fp32 masters, gradients
  /// and AdamW moments, the bf16 copy, embed / lm_head [V, d] bf16, the RoPE table, the clip's
  /// scratch and the cuBLASLt workspace. The memory plan of a GPU run (src/train/cuda/memory_plan.h).
  static int64_t state_bytes(const DrafterConfig& cfg, int64_t V);
  /// The most one step() of S context rows and num_blocks blocks allocates on the stream beyond the
  /// state, with every row of a block but its first carrying a loss weight (the most a step can
  /// have): from the buffer sizes step() allocates with. ce_chunk_bytes as DrafterGpuStepOptions.
  static int64_t step_bytes(const DrafterConfig& cfg, int64_t V, int64_t S, int64_t num_blocks, bool recompute,
                            int64_t ce_chunk_bytes = int64_t(1) << 30);

  int64_t num_params() const;
  /// The flat fp32 gradient [num_params()] on the device (for a data-parallel all-reduce) and the
  /// stream every method of this object runs on. After zero_grads() with no backward since,
  /// grad_data() zeroes the buffer first (on the stream); the pointer's contents are valid until the
  /// next zero_grads().
  float* grad_data();
  cudaStream_t stream() const;
  /// The cuBLASLt context every product of the step runs on (benchmarks record its calls).
  cuda::GemmContext& gemm();
  const DrafterConfig& config() const { return cfg_; }

  struct Impl;

 private:
  void allocate(int64_t V);
  std::unique_ptr<Impl> impl_;
  DrafterConfig cfg_;
};

}  // namespace dflash
