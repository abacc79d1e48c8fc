// The CPU-only build's GPU benchmarks: each says the build has no CUDA backend and exits with 2.
#include <fmt/core.h>

#include "bench/cuda/decode_bench.h"
#include "bench/cuda/drafter_step_bench.h"
#include "bench/cuda/forward_bench.h"
#include "bench/cuda/pipeline_bench.h"
#include "gpu/backend.h"

namespace dflash {

namespace {

int refuse(const char* bench) {
  fmt::print(stderr, "{}\n", no_cuda_backend(std::string("dflash bench ") + bench));
  return 2;
}

}  // namespace

int run_gdn_bench(const GdnBenchOptions&) { return refuse("gdn"); }
int run_target_forward_gpu_bench(const TargetForwardGpuOptions&) { return refuse("target-forward"); }
int run_decode_bench(const DecodeBenchOptions&) { return refuse("decode"); }
int run_drafter_step_bench(const DrafterStepBenchOptions&) { return refuse("drafter-step"); }
int run_pipeline_bench(const PipelineBenchOptions&) { return refuse("pipeline"); }

}  // namespace dflash
