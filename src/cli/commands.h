// Subcommands of the `dflash` program; each file in src/cli/ registers one.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace dflash::cli {

/// A subcommand's run function: returns the process exit code. Set by the add_* functions.
using Runner = std::function<int()>;

void add_inspect(CLI::App& app, Runner& run);
void add_forward(CLI::App& app, Runner& run);
void add_train(CLI::App& app, Runner& run);
void add_bench(CLI::App& app, Runner& run);
void add_bench_tokenize(CLI::App& bench, Runner& run);
void add_prepare(CLI::App& app, Runner& run);
void add_tokenize(CLI::App& app, Runner& run);
void add_generate(CLI::App& app, Runner& run);
void add_eval(CLI::App& app, Runner& run);

}  // namespace dflash::cli
