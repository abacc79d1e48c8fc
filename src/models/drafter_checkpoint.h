// Writing a DFlash drafter checkpoint in the published format (docs/interop.md): config.json +
// model.safetensors (BF16, names without a "model." prefix), and how it is served. What loads it:
// SGLang (--speculative-algorithm DFLASH), vLLM (method "dflash"), z-lab's
// DFlashDraftModel.from_pretrained, and load_drafter_weights here. What does not: transformers'
// AutoModel.from_pretrained(..., trust_remote_code=True), z-lab's README path (no modeling file is
// shipped: it would build a plain Qwen3Model and drop fc / hidden_norm).
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

/// The commands that serve the checkpoint `drafter_dir` beside `target` (the Hugging Face checkpoint
/// of the same model: a directory or a hub id), one line each, shell-quoted:
///   SGLang: --speculative-algorithm DFLASH, --speculative-num-draft-tokens = block_size (SGLang
///           reads block_size and warns when the flag differs);
///   vLLM:   --speculative-config {"method": "dflash", ..., "num_speculative_tokens": block_size - 1}
///           (vLLM never reads block_size: a wrong count silently lowers tau), behind
///           VLLM_USE_V2_MODEL_RUNNER=1 for a drafter that mixes sliding and full layers (vLLM refuses
///           it on its first runner).
/// A DSpark drafter (drafts block_size tokens, verifies block_size + 1): SGLang --speculative-algorithm
/// DSPARK with --speculative-num-draft-tokens block_size + 1 (its gamma + 1); vLLM method "dspark"
/// with num_speculative_tokens block_size.
/// Loading by `DFlashDraftModel.from_pretrained` (z-lab's package) works too; `AutoModel` with
/// trust_remote_code does not (no modeling file is shipped).
std::string serving_commands(const std::string& target, const std::string& drafter_dir, const DrafterConfig& cfg);

/// File name of the training state inside a checkpoint directory.
inline constexpr const char* kTrainingStateFile = "training_state.safetensors";

}  // namespace dflash
