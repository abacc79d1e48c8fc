// Shapes of the GPU benchmarks (random weights, the real models' shapes): the drafter of
// `dflash bench drafter-step` and the target + drafter pair of `dflash bench pipeline`. Host code,
// built with and without CUDA, so the presets and their refusals are checked without a GPU.
#pragma once
#include <cstdint>
#include <string>

#include "models/drafter_config.h"
#include "models/model_spec.h"

namespace dflash {

/// A drafter to benchmark: its config (5 layers, block 16, 32 / 8 heads of 128 except `tiny`, taps
/// from default_target_layer_ids), the target's vocabulary V and the context length S.
struct DrafterBenchPreset {
  DrafterConfig cfg;
  int64_t V = 0, S = 0;
};

/// "qwen3-8b" (d 4096, V 151936, S 3072, 36 target layers), "qwen3.6-27b" (d 5120, V 248320,
/// S 4096, 64 target layers) or "tiny" (d 256, V 1000, S 256: a smoke test of the command).
/// Throws std::invalid_argument "<where>: unknown preset '<name>' (...)" for any other name.
DrafterBenchPreset drafter_bench_preset(const std::string& name, const std::string& where);

/// A frozen target and the drafter trained on its taps (drafter_bench_preset of the same name).
struct PipelineBenchPreset {
  ModelSpec target;
  DrafterBenchPreset drafter;
};

/// "qwen3-8b": the dense Qwen3-8B target (36 layers, hidden 4096, 32 / 8 heads of 128, MLP 12288,
/// vocab 151936, rope theta 1e6, rms eps 1e-6); "tiny": an 8-layer Qwen3 of d 256 (smoke test).
/// "qwen3.6-27b": the Qwen3.6-27B hybrid (48 GatedDeltaNet + 16 gated attention layers). Throws
/// std::invalid_argument for an unknown name or a target the GPU backend cannot run (with the reason).
PipelineBenchPreset pipeline_bench_preset(const std::string& name);

}  // namespace dflash
