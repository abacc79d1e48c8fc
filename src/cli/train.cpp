// `dflash train`: the main job. Its pipeline lands with the drafter and training issues; until then
// the command says exactly what is missing instead of pretending to run.
#include <fmt/core.h>

#include "cli/commands.h"

namespace dflash::cli {

void add_train(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("train", "Train a DFlash drafter for a target (not available in this version)");
  cmd->allow_extras();
  cmd->callback([&run] {
    run = [] {
      fmt::print(stderr,
                 "dflash train: not available in this version. What exists: model loading (safetensors, GGUF), "
                 "`dflash inspect` and the CPU reference `dflash forward`. Still missing: the tokenizer and "
                 "dataset readers, the drafter and its training step, the CUDA backend and the training "
                 "pipeline.\n");
      return 2;
    };
  });
}

}  // namespace dflash::cli
