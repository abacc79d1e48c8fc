#include "spec/regenerate.h"

#include <stdexcept>

#include <fstream>

namespace dflash {

RegenerateReport regenerate_to_jsonl(TargetDecoder& target, const Tokenizer& tok, ChatFamily family,
                                     const std::vector<PromptConversation>& convs, const ChatRunOptions& o,
                                     const std::string& path, const std::function<void(int64_t, int64_t)>& progress) {
  const ChatRunResult r = run_chat(target, nullptr, tok, family, convs, o, progress);
  RegenerateReport rep;
  rep.skipped = r.skipped;
  std::vector<nlohmann::json> records(convs.size());
  for (const auto& t : r.turns) {
    nlohmann::json& msgs = records[t.conversation]["messages"];
    if (msgs.is_null()) {
      msgs = nlohmann::json::array();
      for (const auto& m : convs[t.conversation].system) msgs.push_back({{"role", m.role}, {"content", m.content}});
    }
    msgs.push_back({{"role", "user"}, {"content", convs[t.conversation].user_turns[t.turn]}});
    msgs.push_back({{"role", "assistant"}, {"content", t.text}});
    ++rep.turns;
    rep.tokens += int64_t(t.result.tokens.size());
    rep.cut += !t.result.stopped;
  }
  std::string text;
  for (const auto& rec : records)
    if (!rec.is_null()) {
      text += rec.dump() + "\n";
      ++rep.conversations;
    }
  if (rep.conversations == 0)
    throw std::runtime_error("regenerate: no prompt could be answered (" + std::to_string(rep.skipped.size()) +
                             " skipped)");
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) throw std::runtime_error("cannot write " + path);
  return rep;
}

}  // namespace dflash
