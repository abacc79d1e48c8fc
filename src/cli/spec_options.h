// Options shared by `dflash generate`, `dflash eval` and `dflash prepare --regenerate`.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "spec/engines.h"
#include "spec/eval.h"

namespace dflash::cli {

/// Adds --target, --tokenizer, --chat-template, --device (and --drafter when `drafter`) to `cmd`.
void add_engine_options(CLI::App* cmd, EngineOptions& o, bool drafter);
/// Adds --target-dtype bf16|fp8 (models/target_dtype.h) to `cmd`, into `d`.
void add_target_dtype_option(CLI::App* cmd, TargetDtype& d);
/// Adds --max-new-tokens, --temperature, --seed, --batch-size, --thinking / --no-thinking.
void add_chat_run_options(CLI::App* cmd, ChatRunOptions& o, std::string& thinking);
/// A progress(done, total) callback printing "\r<what> done/total turns, rate, ETA" to stderr at
/// most once a second (and at the end, with a newline). `check` runs first on every call (e.g. to
/// throw on an interrupt).
std::function<void(int64_t, int64_t)> progress_printer(const std::string& what, std::function<void()> check = {});
/// Applies --thinking / --no-thinking and the stop tokens of the opened engines to `o`.
void finish_chat_run_options(ChatRunOptions& o, const std::string& thinking, const Engines& e);

}  // namespace dflash::cli
