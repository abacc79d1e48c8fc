// Chat data files -> one packed training directory (src/text/packed.h): the work of `dflash prepare`,
// shared with `dflash train` when it is given raw chat files.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "text/chat_template.h"
#include "text/dataset.h"

namespace dflash {

class Tokenizer;

/// The chat family named `name`, or detected from the tokenizer's own template (throws naming
/// `tok_path` and suggesting --chat-template when it has none).
ChatFamily chat_family_for(const Tokenizer& tok, const std::string& name, const std::string& tok_path);

struct PrepareOptions {
  std::vector<std::string> files;  // JSONL / JSON chat files
  int64_t max_length = 3072;       // samples are truncated to this many tokens
  bool strict = false;             // the first bad record is an error instead of a skip
  std::string tokenizer_path;      // recorded in the manifest
};

struct PrepareReport {
  int64_t samples = 0, tokens = 0, loss_tokens = 0, truncated = 0;
  std::vector<SkippedRecord> skipped;
};

/// Tokenizes every conversation of o.files with `tok` and `family` into the fresh directory `dir`
/// (PackedWriter: it must not exist). Records that cannot be used (prompt-only, refused by the
/// template, no assistant token within max_length) are skipped and listed in the manifest, or throw
/// std::runtime_error naming file:line with o.strict. `stop` is polled between records (true: abort
/// with std::runtime_error "interrupted"). Throws when no sample results. The caller removes `dir` on
/// failure and renames it into place on success.
PrepareReport write_prepared(const Tokenizer& tok, ChatFamily family, const PrepareOptions& o, const std::string& dir,
                             const std::function<bool()>& stop);

}  // namespace dflash
