// What `dflash generate`, `dflash eval` and `dflash prepare --regenerate` open: the target, its
// tokenizer and chat family, an optional drafter, and the decoding engines on a device.
#pragma once
#include <memory>
#include <string>

#include "models/target_dtype.h"
#include "spec/decoder.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace dflash {

struct EngineOptions {
  std::string target;         // checkpoint directory or .gguf
  std::string tokenizer;      // "" = the target's own (its directory, or the GGUF)
  std::string chat_template;  // "" = detected from the tokenizer
  std::string drafter;        // "" = none; a DFlash checkpoint directory or a `dflash train --out` directory
  std::string device = "cpu";
  TargetDtype target_dtype = TargetDtype::kBf16;  // --target-dtype: fp8 with device cuda only
};

struct Engines {
  std::unique_ptr<TargetModel> model;
  std::unique_ptr<Tokenizer> tok;
  ChatFamily family = ChatFamily::ChatML;
  std::string drafter_dir;  // the checkpoint directory actually loaded
  std::unique_ptr<TargetDecoder> target;
  std::unique_ptr<BlockDrafter> drafter;  // null without --drafter
};

/// A `dflash train --out` directory holds its drafter in final/ (or, unfinished, the newest
/// checkpoints/step-N); a checkpoint directory is itself. Throws std::runtime_error naming `path`
/// when neither holds a config.json.
std::string resolve_drafter_dir(const std::string& path);

/// Opens everything, checking before any decoding that the drafter fits the target (hidden size,
/// vocabulary, mask token, target_layer_ids). Throws std::runtime_error / std::invalid_argument
/// naming the file at fault; --device cuda without a CUDA build or GPU is an error.
Engines open_engines(const EngineOptions& o);

}  // namespace dflash
