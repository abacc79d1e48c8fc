// Options shared by `dflash generate`, `dflash eval` and `dflash prepare --regenerate`.
#pragma once
#include <CLI/CLI.hpp>

#include "spec/engines.h"
#include "spec/eval.h"

namespace dflash::cli {

/// Adds --target, --tokenizer, --chat-template, --device (and --drafter when `drafter`) to `cmd`.
void add_engine_options(CLI::App* cmd, EngineOptions& o, bool drafter);
/// Adds --max-new-tokens, --temperature, --seed, --batch-size, --thinking / --no-thinking.
void add_chat_run_options(CLI::App* cmd, ChatRunOptions& o, std::string& thinking);
/// Applies --thinking / --no-thinking and the stop tokens of the opened engines to `o`.
void finish_chat_run_options(ChatRunOptions& o, const std::string& thinking, const Engines& e);

}  // namespace dflash::cli
