// DFlash speculative decoding and plain decoding over the same engine (docs/dflash.md,
// "Serving loop"): prefill, then per step one drafter forward drafts block_size - 1 tokens after the
// last committed one, one target forward verifies the block, the longest prefix the target agrees
// with plus the target's own next token is committed, and the target caches roll back to the commit
// point. At temperature 0 the output equals plain greedy decoding token for token; with sampling the
// verification is speculative sampling (Leviathan et al. 2023, Alg. 1) with the drafter's greedy
// draft as a one-hot proposal, so the output follows the target's distribution.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "spec/decoder.h"

namespace dflash {

struct GenerateOptions {
  int64_t max_new_tokens = 256;
  double temperature = 0;  // 0: greedy
  uint64_t seed = 0;       // sampling: sequence s draws from its own stream (seed, s)
  std::vector<int64_t> stop_token_ids;  // generation of a sequence ends after one of these
  /// Sequences decoded at once (0: all prompts). With fewer slots than prompts, a slot whose
  /// sequence ends takes the next prompt (continuous batching).
  int max_batch = 0;
  /// Called with the number of finished sequences whenever one finishes (progress reports).
  std::function<void(int64_t)> on_finished;
  /// Polled before every step; true ends generate() with std::runtime_error("interrupted").
  std::function<bool()> should_stop;
};

/// One sequence's output and measurements.
struct SequenceResult {
  std::vector<int32_t> tokens;  // generated tokens (the prompt excluded), stop token included
  std::vector<int> accepted;    // per verify step: draft tokens accepted (0 .. B-1); empty without drafter
  bool stopped = false;         // ended on a stop token (else on max_new_tokens or the context limit)
  bool hit_context_limit = false;
  double ttft_ms = 0;    // wall time from the prefill step's start to the first token
  double decode_ms = 0;  // wall time from the first token to the last
};

struct GenerateResult {
  std::vector<SequenceResult> seqs;  // in prompt order
  double wall_ms = 0;                // the whole call
};

/// Generates for every prompt, o.max_batch sequences at a time in lockstep (one target forward per
/// step over all of them). `drafter` null: plain decoding, one token per step. Near the target's
/// max_position_embeddings a sequence steps one token at a time (no draft) and stops at the limit.
/// Throws std::invalid_argument
/// naming the prompt for an empty prompt, an id outside the vocabulary or a prompt that leaves no room
/// below max_position_embeddings, and for a drafter that does not fit the target.
GenerateResult generate(TargetDecoder& target, BlockDrafter* drafter, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateOptions& o);

/// Acceptance statistics over verify steps (docs/dflash.md): tau = mean(accepted + 1).
/// B = the most tokens one verify step commits: the drafts plus one (DrafterConfig::drafts_per_block
/// + 1: DFlash's block_size, DSpark's block_size + 1).
struct AcceptanceStats {
  int64_t block_size = 0, steps = 0;  // block_size: B
  double tau = 0;
  std::vector<int64_t> histogram;    // [B + 1]: steps that committed j tokens (j = accepted + 1 in 1..B)
  std::vector<double> slot_accept;   // [B]: fraction of steps whose draft slot k (1..B-1) was accepted; [0] = 1
};
AcceptanceStats acceptance_stats(const std::vector<SequenceResult>& seqs, int64_t block_size);

}  // namespace dflash
