// `dflash eval` and `dflash prepare --regenerate`: chat prompts through the decoding engine.
// Eval measures a drafter (acceptance length tau, its histogram, per-slot acceptance, TTFT, TPOT
// and the speedup against the same engine without the drafter, docs/dflash.md "Serving
// loop"); regeneration has the target answer a dataset's prompts, as the published recipe trains on
// the target's own responses.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spec/speculative.h"
#include "text/chat_template.h"
#include "text/dataset.h"
#include "text/tokenizer.h"

namespace dflash {

/// A conversation's prompts: the system message (if any) and the user turns; assistant turns of the
/// data are dropped (the target answers every user turn itself, turn after turn).
struct PromptConversation {
  std::vector<ChatMessage> system;  // 0 or 1 message
  std::vector<std::string> user_turns;
  std::string file;
  int64_t line = 0;
};

/// The first `limit` (0: all) conversations of each of the chat files (src/text/dataset.h layouts: GSM8K
/// question / answer, MT-bench turns, messages, ShareGPT), as prompts. Bad records are skipped
/// and listed in *skipped. Throws std::runtime_error when no prompt results, naming the files.
std::vector<PromptConversation> load_prompts(const std::vector<std::string>& files, int64_t limit,
                                             std::vector<SkippedRecord>* skipped);

struct ChatRunOptions {
  GenerateOptions gen;
  int batch_size = 8;             // conversations decoded together
  int64_t max_prompt_tokens = 0;  // 0: up to max_position_embeddings; a longer prompt is skipped
  std::optional<bool> enable_thinking;
};

/// The target's answers to every turn of every conversation, in order, with what generate()
/// measured. Turn r of all conversations runs as a batch before turn r + 1 (which sees the answer).
/// A prompt longer than max_prompt_tokens (or leaving no room to generate) is skipped with a reason.
/// `progress(done, total)` is called whenever a turn is answered.
struct ChatRunResult {
  struct Turn {
    size_t conversation = 0, turn = 0;
    int64_t prompt_tokens = 0;
    SequenceResult result;
    std::string text;  // decoded answer (stop token removed)
  };
  std::vector<Turn> turns;
  std::vector<SkippedRecord> skipped;
  double wall_ms = 0;
};
ChatRunResult run_chat(TargetDecoder& target, BlockDrafter* drafter, const Tokenizer& tok, ChatFamily family,
                       const std::vector<PromptConversation>& convs, const ChatRunOptions& o,
                       const std::function<void(int64_t, int64_t)>& progress = {});

/// Eval report: tau and the rest, from the drafter run and (optional) the plain run.
struct EvalReport {
  AcceptanceStats acceptance;
  int64_t turns = 0, generated_tokens = 0;
  double ttft_ms = 0, tpot_ms = 0;            // drafter run: mean time to the first token, decode ms per token
  double plain_ttft_ms = 0, plain_tpot_ms = 0;  // plain run (0 when not run)
  double speedup = 0;                         // plain_tpot / tpot (0 when no plain run)
  int64_t identical = -1;                     // turns whose output equals the plain run's (-1: not compared)
  struct PerFile {
    std::string file;
    AcceptanceStats acceptance;
    int64_t turns = 0;
  };
  std::vector<PerFile> per_file;              // one per data file, in order (tau of each dataset)
  nlohmann::json to_json() const;
  /// A readable table (tau, histogram, per-slot acceptance, timings).
  std::string table() const;
};
/// `convs` are the conversations both runs answered (for the per-file breakdown).
EvalReport make_eval_report(const std::vector<PromptConversation>& convs, const ChatRunResult& spec,
                            const ChatRunResult* plain, int64_t block_size);

}  // namespace dflash
