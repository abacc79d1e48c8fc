#include "cli/gpu.h"

#include "gpu/device_info.h"
#include "gpu/runtime.h"
#include "models/cuda/target_gpu.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/gemm.h"

namespace dflash::cli {

nlohmann::json gpu_weight_bytes(const ModelSpec& s) {
  if (!gpu_unsupported_reason(s).empty()) return nullptr;
  return {{"bf16", TargetGpu::weight_bytes(s, TargetDtype::kBf16)}, {"fp8", TargetGpu::weight_bytes(s, TargetDtype::kFp8)}};
}

nlohmann::json cuda_description() {
  nlohmann::json gpus = nlohmann::json::array();
  int current = 0;
  const bool have_current = cudaGetDevice(&current) == cudaSuccess;
  for (const auto& d : cuda::devices()) {
    // (a device that cannot be made current says so instead of stopping the listing)
    const std::string no_fp8 =
        cudaSetDevice(d.index) == cudaSuccess ? cuda::fp8_unsupported_reason() : (cudaGetLastError(), "not usable");
    gpus.push_back({{"index", d.index}, {"name", d.name}, {"sm", d.sm}, {"memory_bytes", d.total_memory},
                    {"fp8", no_fp8.empty() ? nlohmann::json("supported") : nlohmann::json("refused: " + no_fp8)}});
  }
  if (have_current) cudaSetDevice(current);
  const char* tune[] = {"auto (target forward: fastest of 8 candidates timed per shape; drafter: cuBLASLt's first)",
                        "off (cuBLASLt's first candidate)", "on (fastest of 8 candidates timed per shape)",
                        "on, logged"};
  return {{"built", true}, {"compiled_archs", cuda::compiled_archs()}, {"devices", gpus},
          {"gemm_tune", tune[int(cuda::gemm_tune_mode())]}};
}

ForwardOutput forward_on_gpu(const TargetModel& target, const std::vector<int32_t>& ids,
                             const std::vector<int64_t>& cu_seqlens, const ForwardOptions& opt, TargetDtype dtype) {
  cuda::require_device("forward --device cuda");
  cudaStream_t stream;
  DFLASH_CUDA_CHECK(cudaStreamCreate(&stream));
  ForwardOutput r;
  {
    TargetGpu gpu(target, stream, dtype);  // throws, saying why, for a model / dtype the GPU cannot run
    r = gpu.forward(ids, cu_seqlens, opt);
  }
  cudaStreamDestroy(stream);
  return r;
}

}  // namespace dflash::cli
