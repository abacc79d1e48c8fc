// `dflash eval`: a drafter's acceptance length on held-out prompts, and the speedup of speculative
// decoding against the same engine without the drafter (docs/dflash.md "Serving loop").
#include <fmt/core.h>

#include <filesystem>

#include "bench/record.h"
#include "cli/commands.h"
#include "cli/spec_options.h"
#include "io/json_file.h"

namespace dflash::cli {

void add_eval(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("eval", "Measure a drafter: acceptance length tau, per-slot acceptance, speedup");
  static EngineOptions eo;
  static ChatRunOptions co;
  static std::vector<std::string> data;
  static std::string thinking = "default", report, results = "bench/results", preset;
  static int64_t limit = 0;
  static bool no_baseline = false, record = false;
  add_engine_options(cmd, eo, true);
  cmd->get_option("--drafter")->required();
  cmd->add_option("--data", data, "Prompt files (JSONL / JSON: GSM8K, MT-bench, messages, ShareGPT)")->required();
  cmd->add_option("--limit", limit, "Use the first K conversations of each data file (0: all)")->capture_default_str()->check(CLI::Range(int64_t(0), int64_t(1) << 40));
  cmd->add_flag("--no-baseline", no_baseline, "Skip the run without the drafter (no speedup, no losslessness check)");
  cmd->add_option("--report", report, "Write the JSON report here");
  cmd->add_flag("--record", record, "Append tau (and the speedup) to the benchmark records (bench eval)");
  cmd->add_option("--results", results, "Directory of the benchmark records")->capture_default_str();
  cmd->add_option("--preset", preset, "Preset name of the records (default: <target name>-<data file name>)");
  co.batch_size = 1;
  co.gen.max_new_tokens = 256;
  add_chat_run_options(cmd, co, thinking);
  cmd->callback([&run] {
    run = []() -> int {
      namespace fs = std::filesystem;
      std::vector<SkippedRecord> skipped;
      const std::vector<PromptConversation> convs = load_prompts(data, limit, &skipped);
      const Engines e = open_engines(eo);
      finish_chat_run_options(co, thinking, e);
      int64_t turns = 0;
      for (const auto& c : convs) turns += int64_t(c.user_turns.size());
      fmt::print(stderr, "eval: {} conversations ({} turns) from {}; target {} ({}); drafter {} ({})\n", convs.size(),
                 turns, fmt::format("{}", fmt::join(data, ", ")), eo.target, e.target->describe(), e.drafter_dir,
                 e.drafter->describe());
      {  // warm-up (GPU libraries, caches, memory pools), untimed: both runs start warm
        ChatRunOptions w = co;
        w.gen.max_new_tokens = std::min<int64_t>(co.gen.max_new_tokens, 8);
        const std::vector<PromptConversation> first{{convs[0].system, {convs[0].user_turns[0]}, convs[0].file, convs[0].line}};
        run_chat(*e.target, e.drafter.get(), *e.tok, e.family, first, w);
        run_chat(*e.target, nullptr, *e.tok, e.family, first, w);
      }
      const ChatRunResult spec =
          run_chat(*e.target, e.drafter.get(), *e.tok, e.family, convs, co, progress_printer("eval: with the drafter"));
      ChatRunResult plain;
      if (!no_baseline) plain = run_chat(*e.target, nullptr, *e.tok, e.family, convs, co, progress_printer("eval: baseline"));
      for (const auto& s : spec.skipped) fmt::print(stderr, "skipped {}:{}: {}\n", s.file, s.line, s.reason);
      const int64_t B = e.drafter->config().drafts_per_block() + 1;  // tokens one verify step can commit
      const EvalReport rep = make_eval_report(convs, spec, no_baseline ? nullptr : &plain, B);
      fmt::print("{}", rep.table());
      if (co.gen.temperature == 0 && rep.identical >= 0 && rep.identical < rep.turns)
        fmt::print("note: {} of {} answers differ from plain greedy decoding (floating-point ties or near-ties between "
                   "batched and one-token forwards)\n",
                   rep.turns - rep.identical, rep.turns);
      nlohmann::json j = rep.to_json();
      j["target"] = eo.target;
      j["drafter"] = e.drafter_dir;
      j["data"] = data;
      j["conversations"] = convs.size();
      j["skipped"] = spec.skipped.size() + skipped.size();
      j["max_new_tokens"] = co.gen.max_new_tokens;
      j["temperature"] = co.gen.temperature;
      j["batch_size"] = co.batch_size;
      j["engine"] = e.target->describe();
      if (!report.empty()) {
        write_file_atomic(report, j.dump(2) + "\n");
        fmt::print("eval: wrote {}\n", report);
      }
      if (record) {
        std::string name = preset;
        if (name.empty())
          name = fs::path(eo.target).filename().replace_extension("").string() + "-" +
                 fs::path(data[0]).stem().string();
        nlohmann::json extra{{"drafter", e.drafter_dir}, {"turns", rep.turns}, {"verify_steps", rep.acceptance.steps},
                             {"max_new_tokens", co.gen.max_new_tokens}, {"temperature", co.gen.temperature},
                             {"engine", e.target->describe()}};
        const bool gpu = eo.device == "cuda";
        append_bench_record(results, {"eval", name, "tau", rep.acceptance.tau, "tokens/step", "", "", "", extra}, gpu);
        if (rep.identical >= 0)
          append_bench_record(results, {"eval", name, "speedup", rep.speedup, "x", "", "", "", extra}, gpu);
        fmt::print("eval: appended to {}/eval.jsonl (preset {})\n", results, name);
      }
      return 0;
    };
  });
}

}  // namespace dflash::cli
