#include "spec/eval.h"

#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <stdexcept>

namespace dflash {

std::vector<PromptConversation> load_prompts(const std::vector<std::string>& files, int64_t limit,
                                             std::vector<SkippedRecord>* skipped) {
  std::vector<PromptConversation> r;
  std::vector<SkippedRecord> sk;
  for (const std::string& f : files) {
    int64_t taken = 0;
    read_chat_file(f, false, [&](Conversation&& c) {
      if (limit > 0 && taken >= limit) return;
      PromptConversation p;
      p.file = c.file;
      p.line = c.line;
      for (ChatMessage& m : c.messages) {
        if (m.role == "system" && p.user_turns.empty() && p.system.empty()) p.system.push_back(std::move(m));
        else if (m.role == "user") p.user_turns.push_back(std::move(m.content));
      }
      if (p.user_turns.empty()) {
        sk.push_back({c.file, c.line, "no user turn"});
        return;
      }
      r.push_back(std::move(p));
      ++taken;
    }, sk);
  }
  if (skipped) *skipped = sk;
  if (r.empty()) {
    std::string names;
    for (const auto& f : files) names += (names.empty() ? "" : ", ") + f;
    throw std::runtime_error(names + ": no prompt to run (" +
                             (sk.empty() ? std::string("no records")
                                         : std::to_string(sk.size()) + (sk.size() == 1 ? " record" : " records") +
                                               " skipped, the first: " + sk[0].file + ":" + std::to_string(sk[0].line) +
                                               ": " + sk[0].reason) +
                             ")");
  }
  return r;
}

ChatRunResult run_chat(TargetDecoder& target, BlockDrafter* drafter, const Tokenizer& tok, ChatFamily family,
                       const std::vector<PromptConversation>& convs, const ChatRunOptions& o,
                       const std::function<void(int64_t, int64_t)>& progress) {
  if (o.batch_size < 1) throw std::invalid_argument("batch size must be at least 1");
  const ModelSpec& spec = target.spec();
  const int64_t room = spec.max_position_embeddings > 0 ? spec.max_position_embeddings - 1 : INT64_MAX;
  const int64_t max_prompt = o.max_prompt_tokens > 0 ? std::min(o.max_prompt_tokens, room) : room;
  ChatRunResult r;
  std::vector<std::vector<ChatMessage>> history(convs.size());
  std::vector<bool> alive(convs.size(), true);
  int64_t total = 0, done = 0;
  for (const auto& c : convs) total += int64_t(c.user_turns.size());
  for (size_t turn = 0;; ++turn) {
    // The prompts of this round: conversation i's history + its user turn `turn`.
    std::vector<size_t> who;
    std::vector<std::vector<int32_t>> prompts;
    for (size_t i = 0; i < convs.size(); ++i) {
      if (!alive[i] || turn >= convs[i].user_turns.size()) continue;
      if (turn == 0) history[i] = convs[i].system;
      history[i].push_back({"user", convs[i].user_turns[turn], std::nullopt});
      ChatOptions co;
      co.add_generation_prompt = true;
      co.enable_thinking = o.enable_thinking;
      std::vector<int32_t> ids;
      std::string why;
      try {
        ids = tok.encode(render_chat_text(family, history[i], co), false);
        if (int64_t(ids.size()) > max_prompt)
          why = fmt::format("turn {}: the prompt has {} tokens, more than {}", turn + 1, ids.size(), max_prompt);
      } catch (const std::invalid_argument& e) {
        why = fmt::format("turn {}: {}", turn + 1, e.what());
      }
      if (!why.empty()) {
        r.skipped.push_back({convs[i].file, convs[i].line, why});
        alive[i] = false;
        done += int64_t(convs[i].user_turns.size() - turn);
        continue;
      }
      who.push_back(i);
      prompts.push_back(std::move(ids));
    }
    if (who.empty()) break;
    // One round: every conversation's next turn, o.batch_size at a time (continuous batching).
    GenerateOptions g = o.gen;
    g.max_batch = o.batch_size;
    g.seed = o.gen.seed + 0x9E3779B97F4A7C15ull * turn;  // other sampling streams for each turn
    if (progress) g.on_finished = [&, base = done](int64_t k) { progress(base + k, total); };
    const GenerateResult res = generate(target, drafter, prompts, g);
    r.wall_ms += res.wall_ms;
    for (size_t j = 0; j < who.size(); ++j) {
      ChatRunResult::Turn t;
      t.conversation = who[j];
      t.turn = turn;
      t.prompt_tokens = int64_t(prompts[j].size());
      t.result = res.seqs[j];
      std::vector<int32_t> answer = t.result.tokens;
      if (t.result.stopped && !answer.empty()) answer.pop_back();
      t.text = tok.decode(answer);
      history[who[j]].push_back({"assistant", t.text, std::nullopt});
      r.turns.push_back(std::move(t));
    }
    done += int64_t(who.size());
  }
  if (progress && done < total) progress(total, total);  // the last conversations were skipped
  std::sort(r.turns.begin(), r.turns.end(), [](const auto& a, const auto& b) {
    return std::tie(a.conversation, a.turn) < std::tie(b.conversation, b.turn);
  });
  return r;
}

namespace {
/// Mean time to the first token, and decode time per token after each turn's first, per sequence.
std::pair<double, double> ttft_tpot_ms(const ChatRunResult& r) {
  int64_t n = 0;
  double ttft = 0, decode = 0;
  for (const auto& t : r.turns) {
    n += std::max<int64_t>(int64_t(t.result.tokens.size()) - 1, 0);
    ttft += t.result.ttft_ms;
    decode += t.result.decode_ms;
  }
  return {r.turns.empty() ? 0 : ttft / double(r.turns.size()), n ? decode / double(n) : 0};
}
}  // namespace

EvalReport make_eval_report(const std::vector<PromptConversation>& convs, const ChatRunResult& spec,
                            const ChatRunResult* plain, int64_t B) {
  EvalReport e;
  std::vector<SequenceResult> seqs;
  std::vector<std::string> files;
  std::vector<std::vector<SequenceResult>> by_file;
  for (const auto& t : spec.turns) {
    seqs.push_back(t.result);
    e.generated_tokens += int64_t(t.result.tokens.size());
    const std::string& f = convs.at(t.conversation).file;
    const size_t k = size_t(std::find(files.begin(), files.end(), f) - files.begin());
    if (k == files.size()) files.push_back(f), by_file.emplace_back();
    by_file[k].push_back(t.result);
  }
  for (size_t k = 0; k < files.size(); ++k)
    e.per_file.push_back({files[k], acceptance_stats(by_file[k], B), int64_t(by_file[k].size())});
  e.turns = int64_t(spec.turns.size());
  e.acceptance = acceptance_stats(seqs, B);
  std::tie(e.ttft_ms, e.tpot_ms) = ttft_tpot_ms(spec);
  if (plain) {
    std::tie(e.plain_ttft_ms, e.plain_tpot_ms) = ttft_tpot_ms(*plain);
    e.speedup = e.tpot_ms > 0 ? e.plain_tpot_ms / e.tpot_ms : 0;
    e.identical = 0;
    std::map<std::pair<size_t, size_t>, const std::vector<int32_t>*> by_turn;  // (conversation, turn)
    for (const auto& t : plain->turns) by_turn[{t.conversation, t.turn}] = &t.result.tokens;
    for (const auto& t : spec.turns) {
      auto it = by_turn.find({t.conversation, t.turn});
      e.identical += it != by_turn.end() && *it->second == t.result.tokens;
    }
  }
  return e;
}

nlohmann::json EvalReport::to_json() const {
  nlohmann::json j{{"tau", acceptance.tau},
                   {"verify_steps", acceptance.steps},
                   {"block_size", acceptance.block_size},
                   {"accept_length_histogram", acceptance.histogram},
                   {"slot_acceptance", acceptance.slot_accept},
                   {"turns", turns},
                   {"generated_tokens", generated_tokens},
                   {"ttft_ms", ttft_ms},
                   {"tpot_ms", tpot_ms}};
  j["per_file"] = nlohmann::json::array();
  for (const auto& f : per_file)
    j["per_file"].push_back({{"file", f.file}, {"tau", f.acceptance.tau}, {"turns", f.turns},
                             {"verify_steps", f.acceptance.steps}});
  if (identical >= 0) {
    j["plain_ttft_ms"] = plain_ttft_ms;
    j["plain_tpot_ms"] = plain_tpot_ms;
    j["speedup"] = speedup;
    j["identical_outputs"] = identical;
  }
  return j;
}

std::string EvalReport::table() const {
  const auto& a = acceptance;
  std::string s = fmt::format("acceptance length tau  {:.3f}  ({} verify steps, block size {}, {} turns, {} tokens)\n",
                              a.tau, a.steps, a.block_size, turns, generated_tokens);
  if (per_file.size() > 1)
    for (const auto& f : per_file)
      s += fmt::format("  {}: tau {:.3f} ({} turns, {} verify steps)\n", f.file, f.acceptance.tau, f.turns,
                       f.acceptance.steps);
  s += "tokens committed per step (accepted + 1):\n";
  for (int64_t j = 1; j < int64_t(a.histogram.size()); ++j)
    s += fmt::format("  {:>2}  {:>7}  {:5.1f} %\n", j, a.histogram[size_t(j)],
                     a.steps ? 100.0 * double(a.histogram[size_t(j)]) / double(a.steps) : 0.0);
  s += "per-slot acceptance (draft slot k accepted):\n ";
  for (int64_t k = 1; k < int64_t(a.slot_accept.size()); ++k) s += fmt::format(" {}:{:.2f}", k, a.slot_accept[size_t(k)]);
  s += fmt::format("\nTTFT {:.1f} ms, TPOT {:.2f} ms", ttft_ms, tpot_ms);
  if (identical >= 0)
    s += fmt::format("  |  without drafter: TTFT {:.1f} ms, TPOT {:.2f} ms  |  speedup {:.2f}x  |  outputs identical "
                     "to plain decoding: {} of {}",
                     plain_ttft_ms, plain_tpot_ms, speedup, identical, turns);
  return s + "\n";
}

}  // namespace dflash
