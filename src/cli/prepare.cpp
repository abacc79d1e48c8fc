// `dflash prepare`: chat data files -> a packed, memory-mapped training directory (src/text/packed.h).
#include <fmt/core.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>

#include "cli/commands.h"
#include "text/chat_template.h"
#include "text/dataset.h"
#include "text/packed.h"
#include "text/sample.h"
#include "text/tokenizer.h"

namespace dflash::cli {

namespace {

std::atomic<bool> g_interrupted{false};
void on_signal(int) { g_interrupted = true; }

struct SourceStats {
  int64_t records = 0, samples = 0, skipped = 0, tokens = 0, truncated = 0;
};

}  // namespace

ChatFamily chat_family_for(const Tokenizer& tok, const std::string& name, const std::string& tok_path) {
  if (!name.empty()) return chat_family_from_name(name);
  if (tok.chat_template().empty())
    throw std::runtime_error(tok_path + ": the tokenizer has no chat_template; pass --chat-template NAME");
  return detect_chat_family(tok.chat_template());
}

void add_prepare(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("prepare", "Tokenize chat data into a packed training directory");
  static std::string tok_path, out, chat_template;
  static std::vector<std::string> data;
  static int64_t max_length = 3072;
  static bool strict = false, overwrite = false;
  cmd->add_option("--tokenizer", tok_path, "tokenizer.json, a directory holding one, or a .gguf")->required();
  cmd->add_option("--data", data, "JSONL or JSON files (messages, ShareGPT, prompt/answer records)")->required();
  cmd->add_option("--out", out, "Output directory (must not exist unless --overwrite)")->required();
  cmd->add_option("--max-length", max_length, "Truncate samples to this many tokens")->check(CLI::Range(int64_t(2), int64_t(1) << 24));
  cmd->add_option("--chat-template", chat_template, "Template family: qwen3, qwen3.5 (= qwen3.6), qwen3.5-nothink, smollm2, chatml, llama3, llama3.1 (default: detected)");
  cmd->add_flag("--strict", strict, "Stop at the first bad record instead of skipping it");
  cmd->add_flag("--overwrite", overwrite, "Replace an existing output directory");
  cmd->callback([&run] {
    run = [] {
      namespace fs = std::filesystem;
      if (fs::exists(out) && !overwrite) throw std::runtime_error(out + ": exists (pass --overwrite to replace it)");
      const auto tok = Tokenizer::load(tok_path);
      const ChatFamily family = chat_family_for(*tok, chat_template, tok_path);
      for (const auto& d : data)
        if (!fs::is_regular_file(d)) throw std::runtime_error(d + ": no such data file");

      const std::string tmp = out + ".partial-" + std::to_string(::getpid());
      std::signal(SIGINT, on_signal);
      std::signal(SIGTERM, on_signal);
      std::vector<SkippedRecord> skipped;
      nlohmann::json sources = nlohmann::json::array();
      try {
        PackedWriter w(tmp);
        for (const auto& file : data) {
          SourceStats st;
          const size_t skipped_before = skipped.size();
          read_chat_file(file, strict, [&](Conversation&& c) {
            if (g_interrupted) throw std::runtime_error("interrupted");
            ++st.records;
            if (c.prompt_only) {
              const std::string why = "prompt-only record (no assistant turn): its responses must be generated first";
              if (strict) throw std::runtime_error(c.file + ":" + std::to_string(c.line) + ": " + why);
              skipped.push_back({c.file, c.line, why});
              return;
            }
            bool truncated = false;
            Sample s = build_sample(*tok, family, c, max_length, &truncated);
            int64_t loss = 0;
            for (uint8_t m : s.loss_mask) loss += m;
            if (loss == 0) {
              const std::string why = "no assistant token within --max-length " + std::to_string(max_length);
              if (strict) throw std::runtime_error(c.file + ":" + std::to_string(c.line) + ": " + why);
              skipped.push_back({c.file, c.line, why});
              return;
            }
            w.add(s);
            ++st.samples;
            st.tokens += int64_t(s.ids.size());
            st.truncated += truncated;
            if (w.num_samples() % 10000 == 0)
              fmt::print(stderr, "prepare: {} samples, {} tokens\n", w.num_samples(), w.num_tokens());
          }, skipped);
          st.skipped = int64_t(skipped.size() - skipped_before);
          sources.push_back({{"file", fs::absolute(file).string()}, {"records", st.records}, {"samples", st.samples},
                             {"skipped", st.skipped}, {"tokens", st.tokens}, {"truncated", st.truncated}});
        }
        nlohmann::json sk = nlohmann::json::array();
        for (size_t i = 0; i < skipped.size() && i < 10000; ++i)
          sk.push_back({{"file", skipped[i].file}, {"line", skipped[i].line}, {"reason", skipped[i].reason}});
        int64_t truncated = 0;
        for (const auto& s : sources) truncated += s["truncated"].get<int64_t>();
        w.finish({{"tokenizer", fs::absolute(tok_path).string()}, {"chat_template", chat_family_name(family)},
                  {"max_length", max_length}, {"sources", sources}, {"num_truncated", truncated},
                  {"num_skipped", skipped.size()}, {"skipped", sk}});
        if (fs::exists(out)) fs::remove_all(out);  // --overwrite (checked above)
        fs::rename(tmp, out);
        fmt::print("prepare: wrote {}: {} samples, {} tokens ({} with loss), {} truncated to {}, {} records skipped\n",
                   out, w.num_samples(), w.num_tokens(), w.num_loss_tokens(), truncated, max_length, skipped.size());
      } catch (...) {
        std::error_code ec;
        fs::remove_all(tmp, ec);
        if (g_interrupted) throw std::runtime_error("prepare interrupted: nothing was written to " + out);
        throw;
      }
      for (size_t i = 0; i < skipped.size() && i < 5; ++i)
        fmt::print("  skipped {}:{}: {}\n", skipped[i].file, skipped[i].line, skipped[i].reason);
      if (skipped.size() > 5) fmt::print("  ... {} more in {}/manifest.json\n", skipped.size() - 5, out);
      return 0;
    };
  });
}

}  // namespace dflash::cli
