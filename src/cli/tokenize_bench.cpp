// `dflash bench tokenize`: single-thread tokenization speed on a JSONL corpus (GSM8K: question + "\n" +
// answer per record, exactly as scripts/bench_tokenizers_py.py times the Python `tokenizers` library),
// appended to bench/results/tokenize.jsonl (see src/bench/record.h).
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench/record.h"
#include "cli/commands.h"
#include "text/tokenizer.h"

namespace dflash::cli {

namespace {

// Texts of a JSONL file: question + "\n" + answer, or "text".
std::vector<std::string> read_texts(const std::string& path, int64_t limit) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error(path + ": cannot open");
  std::vector<std::string> texts;
  std::string line;
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json r;
    try {
      r = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(fmt::format("{}:{}: invalid JSON: {}", path, n, e.what()));
    }
    if (r.contains("question") && r["question"].is_string() && r.contains("answer") && r["answer"].is_string())
      texts.push_back(r["question"].get<std::string>() + "\n" + r["answer"].get<std::string>());
    else if (r.contains("text") && r["text"].is_string())
      texts.push_back(r["text"].get<std::string>());
    else
      throw std::runtime_error(fmt::format("{}:{}: expected string \"question\" and \"answer\", or \"text\"", path, n));
    if (limit > 0 && int64_t(texts.size()) >= limit) break;
  }
  if (texts.empty()) throw std::runtime_error(path + ": no records");
  return texts;
}

}  // namespace

void add_bench_tokenize(CLI::App& bench, Runner& run) {
  auto* cmd = bench.add_subcommand("tokenize", "Time single-thread tokenization of a JSONL corpus (tokens/s, MB/s)");
  static std::string tok_path, data, preset, results = "bench/results";
  static int repeat = 5;
  static int64_t limit = 0;
  static bool no_record = false;
  cmd->add_option("--tokenizer", tok_path, "tokenizer.json, a directory holding one, or a .gguf")->required();
  cmd->add_option("--data", data, "JSONL: {question, answer} (joined with a newline) or {text} per line")->required();
  cmd->add_option("--repeat", repeat, "Timed passes after one warm-up pass (the median is recorded)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--limit", limit, "Use the first N records only (0: all)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--preset", preset, "Preset name in the record (default: <tokenizer>-<data dir>-<data file>-dflash)");
  cmd->add_option("--results", results, "Directory of the JSONL records")->capture_default_str();
  cmd->add_flag("--no-record", no_record, "Print only; append nothing to the results");
  cmd->callback([&run] {
    run = [] {
      namespace fs = std::filesystem;
      const auto t_load = std::chrono::steady_clock::now();
      const auto tok = Tokenizer::load(tok_path);
      const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
      const auto texts = read_texts(data, limit);
      int64_t bytes = 0;
      for (const auto& t : texts) bytes += int64_t(t.size());
      int64_t tokens = 0;
      double cold_s = 0;  // pass 0, on an empty word cache
      std::vector<double> secs;
      for (int r = 0; r <= repeat; ++r) {  // pass 0 is the warm-up (fills the word cache)
        int64_t n = 0;
        const auto t0 = std::chrono::steady_clock::now();
        for (const auto& t : texts) n += int64_t(tok->encode(t, false).size());
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r == 0) {
          tokens = n;
          cold_s = s;
        } else
          secs.push_back(s);
      }
      std::sort(secs.begin(), secs.end());
      const double med = secs[secs.size() / 2];
      fs::path tp = fs::path(tok_path);
      if (tp.filename().empty()) tp = tp.parent_path();  // "dir/"
      std::string tok_name = fs::is_directory(tp) ? tp.filename().string() : tp.stem().string();
      if (tok_name == "tokenizer") tok_name = tp.parent_path().filename().string();
      const fs::path dp(data);
      BenchRecord rec;
      rec.bench = "tokenize";
      rec.preset = preset.empty() ? fmt::format("{}-{}-{}-dflash", tok_name, dp.parent_path().filename().string(), dp.stem().string())
                                  : preset;
      rec.metric = "tokens_per_s";
      rec.value = double(tokens) / med;
      rec.unit = "tokens/s";
      rec.extra = {{"implementation", "dflash C++ (PCRE2 JIT split, byte-level BPE, word cache)"},
                   {"threads", 1},
                   {"texts", int64_t(texts.size())},
                   {"tokens", tokens},
                   {"bytes", bytes},
                   {"mb_per_s", double(bytes) / med / 1e6},
                   {"repeat", repeat},
                   {"median_s", med},
                   {"min_s", secs.front()},
                   {"max_s", secs.back()},
                   {"load_s", load_s},
                   {"cold_first_pass_s", cold_s},
                   {"cold_tokens_per_s", double(tokens) / cold_s},
                   {"data", dp.filename().string()},
                   {"text", "question + \\n + answer"},
                   {"add_special_tokens", false}};
      print_bench_record(results, rec, !no_record);
      return 0;
    };
  });
}

}  // namespace dflash::cli
