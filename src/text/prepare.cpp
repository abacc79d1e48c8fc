#include "text/prepare.h"

#include <fmt/core.h>

#include <filesystem>
#include <stdexcept>

#include "text/packed.h"
#include "text/sample.h"
#include "text/tokenizer.h"

namespace dflash {

ChatFamily chat_family_for(const Tokenizer& tok, const std::string& name, const std::string& tok_path) {
  if (!name.empty()) return chat_family_from_name(name);
  if (tok.chat_template().empty())
    throw std::runtime_error(tok_path + ": the tokenizer has no chat_template; pass --chat-template NAME");
  return detect_chat_family(tok.chat_template());
}

PrepareReport write_prepared(const Tokenizer& tok, ChatFamily family, const PrepareOptions& o, const std::string& dir,
                             const std::function<bool()>& stop) {
  namespace fs = std::filesystem;
  PrepareReport rep;
  nlohmann::json sources = nlohmann::json::array();
  PackedWriter w(dir);
  for (const auto& file : o.files) {
    int64_t samples = 0, tokens = 0, truncated_here = 0;
    const size_t skipped_before = rep.skipped.size();
    auto skip = [&](const Conversation& c, const std::string& why) {
      if (o.strict) throw std::runtime_error(c.file + ":" + std::to_string(c.line) + ": " + why);
      rep.skipped.push_back({c.file, c.line, why});
    };
    read_chat_file(file, o.strict, [&](Conversation&& c) {
      if (c.prompt_only) {
        skip(c, "prompt-only record (no assistant turn): have the target answer it first (dflash prepare --regenerate --target MODEL)");
        return;
      }
      bool truncated = false;
      Sample s;
      try {
        s = build_sample(tok, family, c, o.max_length, &truncated);
      } catch (const std::invalid_argument& e) {  // the template refuses this conversation
        skip(c, e.what());
        return;
      }
      int64_t loss = 0;
      for (uint8_t m : s.loss_mask) loss += m;
      if (loss == 0) {
        skip(c, "no assistant token within --max-length " + std::to_string(o.max_length));
        return;
      }
      w.add(s);
      ++samples;
      tokens += int64_t(s.ids.size());
      truncated_here += truncated;
      if (w.num_samples() % 10000 == 0)
        fmt::print(stderr, "prepare: {} samples, {} tokens\n", w.num_samples(), w.num_tokens());
    }, rep.skipped, stop);
    const int64_t skipped = int64_t(rep.skipped.size() - skipped_before);
    rep.truncated += truncated_here;
    sources.push_back({{"file", fs::absolute(file).string()}, {"bytes", int64_t(fs::file_size(file))},
                       {"records", samples + skipped}, {"samples", samples},
                       {"skipped", skipped}, {"tokens", tokens}, {"truncated", truncated_here}});
  }
  if (w.num_samples() == 0)
    throw std::runtime_error("prepare: no sample was produced (" + std::to_string(rep.skipped.size()) +
                             " records skipped, e.g. " +
                             (rep.skipped.empty() ? std::string("none")
                                                  : rep.skipped[0].file + ":" + std::to_string(rep.skipped[0].line) +
                                                        ": " + rep.skipped[0].reason) +
                             "); nothing was written");
  nlohmann::json sk = nlohmann::json::array();
  const size_t kMaxListed = 10000;
  for (size_t i = 0; i < rep.skipped.size() && i < kMaxListed; ++i)
    sk.push_back({{"file", rep.skipped[i].file}, {"line", rep.skipped[i].line}, {"reason", rep.skipped[i].reason}});
  w.finish({{"tokenizer", o.tokenizer_path.empty() ? std::string() : fs::absolute(o.tokenizer_path).string()},
            {"chat_template", chat_family_name(family)}, {"max_length", o.max_length}, {"sources", sources},
            {"num_truncated", rep.truncated}, {"num_skipped", rep.skipped.size()}, {"skipped_listed", sk.size()},
            {"skipped", sk}});
  rep.samples = w.num_samples();
  rep.tokens = w.num_tokens();
  rep.loss_tokens = w.num_loss_tokens();
  return rep;
}

}  // namespace dflash
