// Real acceptance during training: speculative decoding of held-out prompts with the drafter as it
// would be saved, against the frozen target, at temperature 0 (`dflash train --eval-data`). Training
// accuracy can look fine while served acceptance is near zero (wrong taps, a template mismatch); this
// measures the served quantity, tau = mean tokens committed per verify step (src/spec/speculative.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/drafter.h"
#include "models/target.h"
#include "models/target_dtype.h"
#include "spec/eval.h"

namespace dflash {

struct TrainEvalResult {
  AcceptanceStats acceptance;  // tau, histogram, per-slot acceptance
  int64_t turns = 0, generated_tokens = 0;
  double ms = 0;               // wall time of the evaluation (its own stage)
};

/// The held-out prompts and how to decode them; `run` decodes them with given drafter weights.
class TrainEval {
 public:
  /// `model` and `tok` must outlive it. device "cpu" or "cuda" (GPU `gpu`: a decoding engine of the
  /// target is built there for each run and freed after it). Throws std::runtime_error when no
  /// prompt loads from `files` (load_prompts).
  /// target_dtype: the training target's (the GPU engine then decodes with the same projections).
  TrainEval(const TargetModel& model, const Tokenizer& tok, ChatFamily family, const std::vector<std::string>& files,
            int64_t limit, int64_t max_new_tokens, int batch_size, std::string device, int gpu,
            TargetDtype target_dtype = TargetDtype::kBf16);
  /// Greedy speculative decoding of every prompt with drafter (cfg, w). Throws what the engines throw.
  TrainEvalResult run(const DrafterConfig& cfg, const DrafterWeights<float>& w) const;
  int64_t conversations() const { return int64_t(convs_.size()); }

 private:
  const TargetModel& model_;
  const Tokenizer& tok_;
  ChatFamily family_;
  std::vector<PromptConversation> convs_;
  ChatRunOptions opt_;
  std::string device_;
  int gpu_;
  TargetDtype target_dtype_;
};

}  // namespace dflash
