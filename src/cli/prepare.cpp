// `dflash prepare`: chat data files -> a packed, memory-mapped training directory (src/text/packed.h).
#include <chrono>
#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <filesystem>

#include "cli/commands.h"
#include "cli/spec_options.h"
#include "io/json_file.h"
#include "io/temp_files.h"
#include "text/chat_template.h"
#include "text/dataset.h"
#include "text/packed.h"
#include "text/prepare.h"
#include "spec/regenerate.h"
#include "text/tokenizer.h"

namespace dflash::cli {

namespace {

std::atomic<bool> g_interrupted{false};
void on_signal(int) { g_interrupted = true; }

}  // namespace

void add_prepare(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("prepare", "Tokenize chat data into a packed training directory");
  static std::string tok_path, out, chat_template;
  static std::vector<std::string> data;
  static int64_t max_length = 3072;
  static bool strict = false, overwrite = false, regenerate = false;
  static EngineOptions eo;
  static ChatRunOptions co;
  static std::string thinking = "default";
  cmd->add_option("--tokenizer", tok_path, "tokenizer.json, a directory holding one, or a .gguf (default with --regenerate: the target's)");
  cmd->add_option("--data", data, "JSONL or JSON files (messages, ShareGPT, prompt/answer records)")->required();
  cmd->add_option("--out", out, "Output directory (must not exist unless --overwrite)")->required();
  cmd->add_option("--max-length", max_length, "Truncate samples to this many tokens")->check(CLI::Range(int64_t(2), int64_t(1) << 24));
  cmd->add_option("--chat-template", chat_template, "Template family: qwen3, qwen3.5 (= qwen3.6), qwen3.5-nothink, smollm2, chatml, llama3, llama3.1 (default: detected)");
  cmd->add_flag("--strict", strict, "Stop at the first bad record instead of skipping it");
  cmd->add_flag("--overwrite", overwrite, "Replace an existing output directory");
  cmd->add_flag("--regenerate", regenerate,
                "Have --target answer every user turn first and train on its answers (written to OUT/regenerated.jsonl)");
  cmd->add_option("--target", eo.target, "Target checkpoint directory or .gguf (with --regenerate)");
  cmd->add_option("--device", eo.device, "Device to decode on (with --regenerate)")->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  add_target_dtype_option(cmd, eo.target_dtype);
  co.batch_size = 32;
  co.gen.max_new_tokens = 2048;
  add_chat_run_options(cmd, co, thinking);
  cmd->callback([&run] {
    run = []() -> int {
      namespace fs = std::filesystem;
      while (out.size() > 1 && out.back() == '/') out.pop_back();  // "DIR/" names DIR
      if (fs::exists(out) && !overwrite) throw std::runtime_error(out + ": exists (pass --overwrite to replace it)");
      if (fs::exists(out) && !is_packed_dir(out))
        throw std::runtime_error(out + ": exists and is not the output of dflash prepare; refusing to replace it");
      if (regenerate == eo.target.empty())
        throw std::runtime_error(regenerate ? "--regenerate needs --target (the model that answers)"
                                            : "--target is used only with --regenerate");
      if (tok_path.empty() && !regenerate) throw std::runtime_error("--tokenizer is required");
      for (const auto& d : data)
        if (!fs::is_regular_file(d)) throw std::runtime_error(d + ": no such data file");
      std::unique_ptr<Engines> engines;
      if (regenerate) {
        eo.tokenizer = tok_path;
        eo.chat_template = chat_template;
        engines = std::make_unique<Engines>(open_engines(eo));
        finish_chat_run_options(co, thinking, *engines);
        co.gen.should_stop = [] { return g_interrupted.load(); };
      }
      const auto tok = regenerate ? std::move(engines->tok) : Tokenizer::load(tok_path);
      const ChatFamily family = chat_family_for(*tok, chat_template, regenerate && tok_path.empty() ? eo.target : tok_path);

      for (const char* marker : {".partial-", ".regenerated-"})
        remove_stale_temp(fs::path(out).parent_path(), marker, "prepare", fs::path(out).filename().string());
      const std::string tmp = out + ".partial-" + std::to_string(::getpid());
      for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_signal);
      PrepareReport rep;
      const std::string regen = out + ".regenerated-" + std::to_string(::getpid());
      try {
        std::vector<std::string> files = data;
        if (regenerate) {
          std::vector<SkippedRecord> skipped;
          const auto convs = load_prompts(data, 0, &skipped);
          fmt::print(stderr, "prepare: {} answers {} conversations ({}, max {} new tokens, batch {})\n", eo.target,
                     convs.size(), engines->target->describe(), co.gen.max_new_tokens, co.batch_size);
          const auto t_regen = std::chrono::steady_clock::now();
          const RegenerateReport rr =
              regenerate_to_jsonl(*engines->target, *tok, family, convs, co, regen,
                                  progress_printer("prepare: regenerated", [] {
                                    if (g_interrupted) throw std::runtime_error("interrupted");
                                  }));
          const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_regen).count();
          fmt::print(stderr, "prepare: regenerated {} turns of {} conversations ({} tokens; {} cut at --max-new-tokens, "
                     "{} skipped) in {:.1f} s: {:.0f} answer tokens/s\n", rr.turns, rr.conversations, rr.tokens, rr.cut,
                     rr.skipped.size() + skipped.size(), secs, secs > 0 ? double(rr.tokens) / secs : 0.0);
          files = {regen};
        }
        rep = write_prepared(*tok, family, {files, max_length, strict, tok_path.empty() ? eo.target : tok_path}, tmp,
                             [] { return g_interrupted.load(); });
        if (regenerate) fs::rename(regen, fs::path(tmp) / "regenerated.jsonl");
        if (fs::exists(out)) fs::remove_all(out);  // --overwrite (checked above)
        fs::rename(tmp, out);
        fmt::print("prepare: wrote {}: {} samples, {} tokens ({} with loss), {} truncated to {}, {} records skipped\n",
                   out, rep.samples, rep.tokens, rep.loss_tokens, rep.truncated, max_length, rep.skipped.size());
      } catch (...) {
        std::error_code ec;
        fs::remove_all(tmp, ec);
        fs::remove(regen, ec);
        if (!g_interrupted) throw;
        fmt::print(stderr, "prepare: interrupted; nothing was written to {}\n", out);
        return 130;
      }
      for (size_t i = 0; i < rep.skipped.size() && i < 5; ++i)
        fmt::print("  skipped {}:{}: {}\n", rep.skipped[i].file, rep.skipped[i].line, rep.skipped[i].reason);
      if (rep.skipped.size() > 5) fmt::print("  ... {} more in {}/manifest.json\n", rep.skipped.size() - 5, out);
      return 0;
    };
  });
}

}  // namespace dflash::cli
