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

}  // namespace dflash::cli

namespace dflash {
class Tokenizer;
enum class ChatFamily;
namespace cli {
/// The chat family of --chat-template NAME, or detected from the tokenizer's own template (throws
/// naming `tok_path` and suggesting --chat-template when it has none).
ChatFamily chat_family_for(const Tokenizer& tok, const std::string& name, const std::string& tok_path);
}  // namespace cli
}  // namespace dflash
