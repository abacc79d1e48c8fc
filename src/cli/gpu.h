// The GPU parts of `dflash inspect` and `dflash forward`: src/cli/cuda/gpu.cpp, or in a CPU-only
// build src/cli/no_cuda.cpp (nothing to list; a forward is refused).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "models/target.h"
#include "models/target_dtype.h"

namespace dflash::cli {

/// The bytes TargetGpu stores model `s` in, {"bf16": n, "fp8": n} (with its GEMM workspace); null when
/// the GPU backend refuses `s` or the build has none.
nlohmann::json gpu_weight_bytes(const ModelSpec& s);

/// The CUDA backend of this build: {"built": true, "compiled_archs", "devices" (each with its FP8
/// support), "gemm_tune"}, or {"built": false}.
nlohmann::json cuda_description();

/// The forward on GPU 0 (TargetGpu on a stream of its own). Throws, saying why, for a model or dtype
/// the GPU cannot run, without a usable GPU, and in a CPU-only build.
ForwardOutput forward_on_gpu(const TargetModel& target, const std::vector<int32_t>& ids,
                             const std::vector<int64_t>& cu_seqlens, const ForwardOptions& opt, TargetDtype dtype);

}  // namespace dflash::cli
