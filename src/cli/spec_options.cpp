#include "cli/spec_options.h"

#include <fmt/core.h>

#include <unistd.h>

#include <chrono>
#include <map>
#include <memory>

namespace dflash::cli {

void add_engine_options(CLI::App* cmd, EngineOptions& o, bool drafter) {
  cmd->add_option("--target", o.target, "Target checkpoint directory or .gguf file")->required();
  if (drafter)
    cmd->add_option("--drafter", o.drafter, "DFlash drafter: a checkpoint directory or a dflash train --out directory");
  cmd->add_option("--tokenizer", o.tokenizer, "tokenizer.json, a directory holding one, or a .gguf (default: the target's)");
  cmd->add_option("--chat-template", o.chat_template,
                  "Template family: qwen3, qwen3.5 (= qwen3.6), qwen3.5-nothink, smollm2, chatml, llama3, llama3.1 "
                  "(default: detected)");
  cmd->add_option("--device", o.device, "Device to decode on")->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  add_target_dtype_option(cmd, o.target_dtype);
}

void add_target_dtype_option(CLI::App* cmd, TargetDtype& d) {
  cmd->add_option("--target-dtype", d,
                  "GPU: the target's projections in bf16, or fp8 (E4M3 weights with per-channel scales, activations "
                  "with per-token scales)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, TargetDtype>{{"bf16", TargetDtype::kBf16},
                                                                             {"fp8", TargetDtype::kFp8}})
                      .description("{bf16,fp8}"))
      ->type_name("TEXT")
      ->default_str("bf16");
}

void add_chat_run_options(CLI::App* cmd, ChatRunOptions& o, std::string& thinking) {
  cmd->add_option("--max-new-tokens", o.gen.max_new_tokens, "Tokens generated per answer at most")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  cmd->add_option("--temperature", o.gen.temperature, "0: greedy; else sampling (speculative sampling with a drafter)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", o.gen.seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "Conversations decoded together")->capture_default_str()->check(CLI::Range(1, 4096));
  cmd->add_option("--thinking", thinking, "Qwen3 / 3.5 templates: on, off or default (the template's)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off", "default"}));
}

std::function<void(int64_t, int64_t)> progress_printer(const std::string& what, std::function<void()> check) {
  using clock = std::chrono::steady_clock;
  auto t0 = std::make_shared<clock::time_point>(clock::now());
  auto last = std::make_shared<clock::time_point>(clock::time_point{});
  auto ended = std::make_shared<bool>(false);
  // A terminal gets one line rewritten every second; a log file a new line every 15 seconds.
  const bool tty = ::isatty(2);
  return [=](int64_t done, int64_t total) {
    if (check) check();
    const auto now = clock::now();
    if (*ended || (done < total && now - *last < std::chrono::seconds(tty ? 1 : 15))) return;
    *ended = done >= total;
    *last = now;
    const double s = std::chrono::duration<double>(now - *t0).count(), rate = s > 0 ? double(done) / s : 0;
    const double eta = rate > 0 ? double(total - done) / rate : 0;
    fmt::print(stderr, "{}{} {}/{} turns ({:.1f}/s, ETA {}m{:02d}s){}", tty ? "\r" : "", what, done, total, rate,
               int(eta) / 60, int(eta) % 60, tty && done < total ? "   " : "\n");
  };
}

void finish_chat_run_options(ChatRunOptions& o, const std::string& thinking, const Engines& e) {
  if (thinking != "default") o.enable_thinking = thinking == "on";
  o.gen.stop_token_ids = chat_stop_tokens(e.model->spec(), *e.tok, e.family);
}

}  // namespace dflash::cli
