// Speculative decoding's two halves behind small interfaces, so that one decoding loop
// (src/spec/speculative.h) drives the CPU reference and the GPU engines alike:
// - TargetDecoder: a frozen target with its caches (attention KV, GatedDeltaNet conv / recurrent
//   state) for a batch of sequences, fed token by token or block by block, rolled back after a verify;
// - BlockDrafter: a DFlash drafter with its context features, drafting block_size - 1 tokens in one
//   forward (docs/dflash.md "Serving loop").
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/drafter.h"
#include "models/target.h"
#include "models/target_dtype.h"
#include "tensor/tensor.h"

namespace dflash {

/// What a TargetDecoder::feed returns for one sequence (n = tokens fed to it).
struct DecodeOutput {
  std::vector<int32_t> argmax;  // [n]: the most likely token after fed token i (first on ties)
  Tensor logits;  // [n, V] fp32: row i predicts the token after fed token i (empty unless asked for)
  Tensor taps;    // [n, K*D] fp32: hidden_states[id + 1] for each tap layer id, concatenated (empty: no taps)
};

/// A target model decoding a batch of sequences. Not thread-safe: one loop drives it.
class TargetDecoder {
 public:
  virtual ~TargetDecoder() = default;
  virtual const ModelSpec& spec() const = 0;
  /// Drops all state and starts `n` empty sequences.
  virtual void reset(int n) = 0;
  /// Empties sequence s (a new prompt starts there).
  virtual void clear(int s) = 0;
  /// Appends tokens[s] to sequence s (tokens.size() == n; an empty list feeds nothing) and runs
  /// them. keep_rollback: rollback() may later drop any suffix of these tokens. logits: return the
  /// full logits too (sampling); the argmax always comes back.
  /// Throws std::invalid_argument for bad ids, std::runtime_error past the engine's capacity.
  virtual std::vector<DecodeOutput> feed(const std::vector<std::vector<int32_t>>& tokens, bool keep_rollback,
                                         bool logits) = 0;
  /// Keeps the first `length` tokens of sequence s; `length` must not be below the length before the
  /// last feed that kept rollback state. Throws std::invalid_argument otherwise.
  virtual void rollback(int s, int64_t length) = 0;
  virtual int64_t length(int s) const = 0;
  /// One line for reports: device and kernels ("cpu reference (fp32)").
  virtual std::string describe() const = 0;
};

/// The CPU reference engine over `model` (TargetModel::forward with a TargetCache), returning the
/// taps of `tap_layer_ids` (a drafter's target_layer_ids; empty: none). `model` must outlive it.
/// Throws std::invalid_argument for a tap layer id outside [0, num_hidden_layers).
std::unique_ptr<TargetDecoder> make_cpu_decoder(const TargetModel& model, std::vector<int64_t> tap_layer_ids);

/// A DFlash drafter drafting for a batch of sequences. Per sequence it holds the target features of
/// the committed tokens (its context); a draft conditions on all of it. Not thread-safe.
class BlockDrafter {
 public:
  virtual ~BlockDrafter() = default;
  virtual const DrafterConfig& config() const = 0;
  /// Drops all state and starts `n` empty sequences.
  virtual void reset(int n) = 0;
  /// Empties sequence s's context (a new prompt starts there).
  virtual void clear(int s) = 0;
  /// Appends the target taps [m, K*D] of sequence s's next m committed positions.
  virtual void append_context(int s, const Tensor& taps) = 0;
  /// For each sequence s with last_tokens[s] >= 0: the block [last_tokens[s], MASK x (B-1)] at
  /// positions ctx_len(s) .. ctx_len(s) + B - 1, one forward; returns config().drafts_per_block()
  /// greedy draft tokens per such sequence (DFlash: slots 1..B-1; DSpark: slots 0..B-1 along its
  /// Markov walk), empty for the others.
  virtual std::vector<std::vector<int32_t>> draft(const std::vector<int32_t>& last_tokens) = 0;
  virtual std::string describe() const = 0;
};

/// The CPU reference drafter: drafter_draft_logits over a DrafterContextCache (src/models/drafter.h;
/// the training forward's computation for one block anchored at the last committed position, the
/// context's keys / values cached as tokens are committed). `embed` / `lm_head` [V, d] (the
/// target's) must outlive it.
std::unique_ptr<BlockDrafter> make_cpu_drafter(const DrafterConfig& cfg, DrafterWeights<float> weights,
                                               const Tensor& embed, const Tensor& lm_head);

/// The GPU engine (CUDA builds, src/spec/cuda; a CPU-only build refuses: spec/no_cuda.cpp): bf16 weights (or FP8 projections, dtype),
/// a KV cache per layer, logits and taps returned as fp32 on the host. Throws std::invalid_argument,
/// saying why, for a model or dtype the GPU backend does not run, std::runtime_error without that GPU.
std::unique_ptr<TargetDecoder> make_gpu_decoder(const TargetModel& model, std::vector<int64_t> tap_layer_ids,
                                                int device, TargetDtype dtype = TargetDtype::kBf16);
/// The GPU drafter (CUDA builds): DrafterGpu drafting from its context key / value cache, all
/// sequences' blocks in one forward (DrafterGpu::draft). head_dim 64 or 128.
std::unique_ptr<BlockDrafter> make_gpu_drafter(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                               const Tensor& embed, const Tensor& lm_head, int device);

// Pieces shared by the engines (src/spec/cpu_engine.cpp).
/// Throws std::invalid_argument for a tap layer id outside [0, num_hidden_layers) of `s`.
void check_tap_layer_ids(const ModelSpec& s, const std::vector<int64_t>& tap_layer_ids);
/// The per-sequence token lists of a feed, packed: ids back to back and cu_seqlens.
void pack_feed(const std::vector<std::vector<int32_t>>& tokens, std::vector<int32_t>* ids, std::vector<int64_t>* cu);
/// Splits a packed forward's output by cu_seqlens into DecodeOutputs: argmax from `argmax` [T] when
/// given, else from f.logits; logits kept when `logits`; taps concatenated from tap_layer_ids.
std::vector<DecodeOutput> split_feed_output(const ForwardOutput& f, const std::vector<int64_t>& cu,
                                            const std::vector<int64_t>& tap_layer_ids,
                                            const std::vector<int32_t>* argmax, bool logits);


}  // namespace dflash
