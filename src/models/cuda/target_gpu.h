// A target on one GPU (Llama / Qwen3, and Qwen3.5 / 3.6 hybrids: GatedDeltaNet and gated attention
// layers), bf16 weights and GEMM inputs, fp32 accumulation and an fp32 residual stream: the forward pass
// of `dflash forward --device cuda` and the taps of GPU training. Same math as TargetModel::forward
// (src/models/target.h), built from the kernels in src/ops/cuda.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/runtime.h"
#include "models/target.h"
#include "models/target_dtype.h"

namespace dflash {
namespace cuda {
class GemmContext;
}

class TargetGpu {
 public:
  /// Uploads `m`'s weights (matrices bf16, or the projections in E4M3 with per-channel scales under
  /// TargetDtype::kFp8; norm weights, conv1d, A_log, dt_bias fp32). Throws std::invalid_argument
  /// naming the reason for a model the GPU backend does not run (gpu_unsupported_reason: e.g. head_dim
  /// outside {64, 128, 256}) and, for kFp8, a GPU without FP8 products (cuda::fp8_unsupported_reason)
  /// or a projection input size that is not a multiple of 16: never a silent bf16 run.
  TargetGpu(const TargetModel& m, cudaStream_t stream, TargetDtype dtype = TargetDtype::kBf16);
  /// Random weights made on the device, from `seed` (benchmarks: no host copy of the model). Shapes
  /// of `spec` as TargetModel::load gives them, stored as the constructor above stores them:
  /// embed_tokens / lm_head [V, D] and every projection bf16 ~ N(0, 0.02^2) (lm_head a copy of
  /// embed_tokens when spec.tie_word_embeddings), norm weights fp32 1; GatedDeltaNet conv1d
  /// ~ N(0, 0.3^2), A_log ~ N(0, 0.5^2), dt_bias 0 (kFp8: the same bf16 weights, quantized). Throws
  /// std::runtime_error for an inconsistent spec (ModelSpec::validate) or on CUDA errors (out of
  /// memory), and std::invalid_argument, as above, for a model or dtype the GPU does not run.
  TargetGpu(const ModelSpec& spec, uint64_t seed, cudaStream_t stream, TargetDtype dtype = TargetDtype::kBf16);
  ~TargetGpu();

  /// As TargetModel::forward (packed batch, cu_seqlens); results copied to the host as float32.
  /// With `argmax`, also the most likely token of every row, computed on the GPU without the logits
  /// leaving it (runs the LM head even when opt.logits is false).
  ForwardOutput forward(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu_seqlens,
                        const ForwardOptions& opt, std::vector<int32_t>* argmax = nullptr);

  /// Training taps: hidden_states[i + 1] for each i in layer_ids (transformers numbering: for the
  /// last layer that is after the final norm), concatenated along features into out [T, K*D] (device
  /// bf16). Layers past the deepest tap are not run. Throws
  /// std::invalid_argument for bad ids, cu_seqlens or layer ids.
  void forward_taps(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu_seqlens,
                    const std::vector<int64_t>& layer_ids, cuda::bf16* out);

  const ModelSpec& spec() const { return spec_; }
  TargetDtype dtype() const;

  /// Device bytes the constructors allocate for `spec`: every layer's arrays as stored here (bf16 or,
  /// under kFp8, E4M3 projections with fp32 scales, fp32 vectors; layer_sizes), embed_tokens and
  /// lm_head, the final norm, the RoPE table and the cuBLASLt workspace. The memory plan of a GPU run
  /// (src/train/cuda/memory_plan.h).
  static int64_t weight_bytes(const ModelSpec& spec, TargetDtype dtype = TargetDtype::kBf16);
  /// The most one forward_taps of `tokens` tokens in `sequences` packed sequences, through layer
  /// `last`, allocates on the stream beyond the weights: run_layers' buffers (forward_sizes), its
  /// uploads, the largest temporary of a layer's kernels (the chunked GatedDeltaNet's, the experts',
  /// the GEMM tuning's scratch copy of the residual stream) and the bf16 staging of the taps (kFp8: and
  /// the quantized input of a product). The taps themselves are the caller's.
  static int64_t forward_taps_bytes(const ModelSpec& spec, int64_t tokens, int64_t sequences, int64_t last,
                                    TargetDtype dtype = TargetDtype::kBf16);

  /// With `on`, every later forward / forward_taps / forward_cached records CUDA events around its
  /// stages (gemm, gated_deltanet, attention, moe, other: norms, SwiGLU, embedding, taps; lm_head:
  /// the final norm, the head and the argmax), which costs some speed; last_stage_ms gives the GPU
  /// time per stage (ms) of the most recent one (synchronizes the stream; empty while off).
  void time_stages(bool on);
  /// The cuBLASLt context of every product of a forward, the LM head's included (benchmarks record
  /// its calls).
  cuda::GemmContext& gemm();
  std::vector<std::pair<std::string, double>> last_stage_ms() const;

  // Decoding (src/spec/decoder.h): a KV cache per layer for a batch of sequences, bf16 keys (after
  // q/k norm and RoPE) and values, grown as needed.
  /// Drops any earlier cache and starts `n_seq` empty sequences (GatedDeltaNet layers: zero conv
  /// windows and recurrent states, fp32). Throws std::runtime_error when out of memory.
  void reset_cache(int n_seq);
  /// As TargetModel::forward with a TargetCache: cu_seqlens [n_seq + 1] gives each cached sequence
  /// its new tokens (positions continue from its length); every layer runs;
  /// logits (when opt.logits) and hidden states come back to the host as float32, and, when
  /// `argmax` is given, the most likely token of every row (computed on the GPU without the logits
  /// leaving it). GatedDeltaNet layers continue each sequence's conv window and state: through the
  /// chunked kernel, or token by token (gated_delta_rule_recurrent) in a decoding step (at most 16 new
  /// tokens in every sequence of the call) and with opt.keep_rollback, which also keeps
  /// each sequence's state before the forward and every new token's recurrence inputs (q, k, v, g,
  /// beta: 2 Hk dk + Hv dv + 2 Hv floats per token and layer, not a Hv x dk x dv state each) so that
  /// truncate_cache can drop any suffix of them. Throws std::invalid_argument for bad ids or cu_seqlens,
  /// std::runtime_error when the cache cannot grow (out of memory).
  ForwardOutput forward_cached(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu_seqlens,
                               const ForwardOptions& opt, std::vector<int32_t>* argmax = nullptr);
  /// Keeps the first `length` tokens of cached sequence s (speculative decoding's rollback, as
  /// TargetCache::rollback): attention layers drop keys / values; GatedDeltaNet layers restore the
  /// window saved after token `length` of the last forward_cached (which must have run with
  /// keep_rollback and begun at or before `length`; std::invalid_argument otherwise) and rebuild the
  /// state by replaying the accepted tokens from the state before it (the same kernel on the same
  /// inputs: the same state; deferred to the next forward_cached, which replays every rolled-back
  /// sequence at once). length 0 empties the sequence.
  void truncate_cache(int s, int64_t length);
  int64_t cached_length(int s) const;

  struct Impl;

 private:
  /// Runs the decoder over a packed batch; calls on_hidden(j, x [T, D] fp32) for each hidden-state
  /// index j (0 = embeddings, j = output of layer j - 1) up to layer `last` (inclusive); returns x.
  /// With `cached`, sequence s continues cached sequence s and its keys / values join the cache.
  cuda::StreamBuffer<float> run_layers(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu, int64_t last,
                                       const std::function<void(int64_t, const float*)>& on_hidden,
                                       bool cached = false, bool keep_rollback = false);
  /// Runs the GatedDeltaNet replays truncate_cache left (each rolled-back sequence's accepted tokens of
  /// the last keep_rollback forward, from the state before it), batched: one launch per layer.
  void replay_accepted();
  ForwardOutput forward_impl(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu,
                             const ForwardOptions& opt, bool cached, std::vector<int32_t>* argmax);
  /// Final norm, hidden_states[L], logits and argmax of x [T, D] into out / argmax.
  void finish_forward(cuda::StreamBuffer<float>& x, int64_t T, const ForwardOptions& opt, ForwardOutput& out,
                      std::vector<int32_t>* argmax);

  std::unique_ptr<Impl> impl_;
  ModelSpec spec_;
};

}  // namespace dflash
