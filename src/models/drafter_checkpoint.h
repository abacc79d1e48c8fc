// Writing a DFlash drafter checkpoint in the published format (../shared/docs/dflash.md,
// "Checkpoint format"): config.json + model.safetensors (BF16, names without a "model." prefix),
// the layout SGLang / vLLM / z-lab load and load_drafter_weights reads back.
#pragma once
#include <functional>
#include <string>

#include "models/drafter.h"
#include "models/drafter_config.h"

namespace dflash {

/// Writes `dir`/config.json (drafter_config_to_json(cfg), pretty-printed) and
/// `dir`/model.safetensors (every parameter of `w` in named() order, rounded to BF16 with
/// round-to-nearest-even (f32_to_bf16), names as drafter_param_shapes(cfg), metadata {"format": "pt"}).
///
/// Atomic: everything is built in `dir + ".tmp-<pid>"` (fsynced), then moved into place with one
/// rename (renameat2 RENAME_EXCHANGE when `dir` already exists, so readers see either the old or the
/// new checkpoint; the old one is then deleted). On any failure the temp directory is removed and
/// `dir` is untouched.
///
/// `dir` may be absent, an empty directory, or an earlier checkpoint (a directory whose entries are
/// only config.json, model.safetensors and training_state.safetensors, config.json included).
///
/// `write_training_state`, when given, is called with the path of kTrainingStateFile inside the temp
/// directory and must write it there (the trainer's state for exact resume; servers ignore it). It is
/// part of the same atomic rename. Anything else (a file, a
/// directory with other entries) is refused with std::runtime_error, as are a missing parent,
/// cfg.validate failures and tensors whose shapes differ from drafter_param_shapes(cfg).
void write_drafter_checkpoint(const std::string& dir, const DrafterConfig& cfg, const DrafterWeights<float>& w,
                              const std::function<void(const std::string& path)>& write_training_state = {});

/// File name of the training state inside a checkpoint directory.
inline constexpr const char* kTrainingStateFile = "training_state.safetensors";

}  // namespace dflash
