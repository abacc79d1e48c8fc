// `dflash prepare --regenerate`: the target answers a dataset's prompts (every user turn, in order),
// so that the drafter trains on the target's own responses, as the published recipe does.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "spec/eval.h"

namespace dflash {

struct RegenerateReport {
  int64_t conversations = 0, turns = 0, tokens = 0;
  int64_t cut = 0;  // answers that ended at max_new_tokens (or the context limit), not at a stop token
  std::vector<SkippedRecord> skipped;
};

/// Answers every conversation's user turns with `target` (plain decoding; greedy or sampled as
/// o.gen says) and writes one JSONL record {"messages": [system?, user, assistant, ...]} per
/// conversation to `path` (the caller's temporary file: prepare moves it into place). A conversation whose first prompt cannot run is skipped
/// and listed; one whose later turn cannot run keeps the turns answered before it.
/// Throws std::runtime_error when nothing could be answered.
RegenerateReport regenerate_to_jsonl(TargetDecoder& target, const Tokenizer& tok, ChatFamily family,
                                     const std::vector<PromptConversation>& convs, const ChatRunOptions& o,
                                     const std::string& path, const std::function<void(int64_t, int64_t)>& progress);

}  // namespace dflash
