// `dflash generate`: a person tries a target, with or without a DFlash drafter, on a prompt or on
// the conversations of a chat file; prints the answers and the acceptance length.
#include <fmt/core.h>

#include "cli/commands.h"
#include "cli/spec_options.h"

namespace dflash::cli {

void add_generate(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("generate", "Answer a prompt with the target (speculative decoding with --drafter)");
  static EngineOptions eo;
  static ChatRunOptions co;
  static std::string prompt, chat, thinking = "default";
  static bool raw = false;
  add_engine_options(cmd, eo, true);
  cmd->add_option("--prompt", prompt, "A user message");
  cmd->add_option("--chat", chat, "A chat file (JSONL / JSON): every conversation's user turns are answered");
  cmd->add_flag("--raw", raw, "Feed --prompt as plain text, without the chat template");
  co.batch_size = 1;
  add_chat_run_options(cmd, co, thinking);
  cmd->callback([&run] {
    run = []() -> int {
      if (prompt.empty() == chat.empty()) throw std::runtime_error("give exactly one of --prompt and --chat");
      const Engines e = open_engines(eo);
      finish_chat_run_options(co, thinking, e);
      fmt::print(stderr, "generate: target {} ({}), {}\n", eo.target, e.target->describe(),
                 e.drafter ? "drafter " + e.drafter_dir + " (" + e.drafter->describe() + ")" : std::string("no drafter"));
      auto cut_note = [](const SequenceResult& r) {
        if (r.hit_context_limit) fmt::print(stderr, "generate: [cut at the target's max_position_embeddings]\n");
        else if (!r.stopped) fmt::print(stderr, "generate: [cut at --max-new-tokens {}]\n", co.gen.max_new_tokens);
      };
      std::vector<SequenceResult> seqs;
      double wall = 0;
      int64_t tokens = 0;
      if (raw) {
        if (prompt.empty()) throw std::runtime_error("--raw needs --prompt");
        const GenerateResult g = generate(*e.target, e.drafter.get(), {e.tok->encode(prompt, false)}, co.gen);
        fmt::print("{}\n", e.tok->decode(g.seqs[0].tokens));
        cut_note(g.seqs[0]);
        seqs = g.seqs;
        wall = g.wall_ms;
      } else {
        std::vector<PromptConversation> convs;
        if (!prompt.empty()) convs.push_back({{}, {prompt}, "--prompt", 1});
        else convs = load_prompts({chat}, 0, nullptr);
        const ChatRunResult r = run_chat(*e.target, e.drafter.get(), *e.tok, e.family, convs, co);
        for (const auto& s : r.skipped) fmt::print(stderr, "skipped {}:{}: {}\n", s.file, s.line, s.reason);
        for (const auto& t : r.turns) {
          if (convs.size() > 1 || convs[0].user_turns.size() > 1)
            fmt::print("--- {}:{} turn {}: {}\n", convs[t.conversation].file, convs[t.conversation].line, t.turn + 1,
                       convs[t.conversation].user_turns[t.turn]);
          fmt::print("{}\n", t.text);
          cut_note(t.result);
          seqs.push_back(t.result);
        }
        wall = r.wall_ms;
      }
      for (const auto& s : seqs) tokens += int64_t(s.tokens.size());
      std::string line = fmt::format("generate: {} tokens in {:.2f} s ({:.1f} tokens/s)", tokens, wall / 1e3,
                                     wall > 0 ? 1e3 * double(tokens) / wall : 0.0);
      if (e.drafter) {
        const AcceptanceStats a = acceptance_stats(seqs, e.drafter->config().drafts_per_block() + 1);
        line += fmt::format(", acceptance length tau {:.2f} over {} verify steps", a.tau, a.steps);
      }
      fmt::print(stderr, "{}\n", line);
      return 0;
    };
  });
}

}  // namespace dflash::cli
