// PowerSampler on the GPU: NVML finds the device by its PCI bus id and samples plausible clocks and
// power while a GEMM loop keeps the GPU busy for 1.5 s.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <chrono>

#include "bench/cuda/bench_util.h"
#include "cuda_test_util.h"
#include "gpu/runtime.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"

using namespace dflash;

using CudaGpuPower = test::GpuTest;

TEST_F(CudaGpuPower, SamplesTheBusyGpu) {
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  const int64_t n = 4096;
  cuda::DeviceArray<cuda::bf16> a(size_t(n * n)), b(size_t(n * n)), c(size_t(n * n));
  cuda::fill_normal(a.data(), n * n, 1, 0.f, 1.f, s);
  cuda::fill_normal(b.data(), n * n, 2, 0.f, 1.f, s);
  cuda::GemmContext g(s);
  PowerSummary p;
  {
    const auto sampler = sample_current_gpu();
    ASSERT_TRUE(sampler->available()) << "NVML (libnvidia-ml.so.1) did not find the GPU by its PCI bus id";
    // 1.5 s of GEMMs (~0.2 ms each): the driver's power reading is a 1-s average.
    const auto t0 = std::chrono::steady_clock::now();
    bool synced = true;
    while (synced && std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1500)) {
      for (int i = 0; i < 100; ++i) g.gemm({n, n, n, false, true}, a.data(), b.data(), c.data());
      synced = cudaStreamSynchronize(s) == cudaSuccess;
    }
    EXPECT_TRUE(synced);
    p = sampler->take()[0];
  }
  cudaStreamDestroy(s);
  EXPECT_GE(p.samples, 20);
  EXPECT_GT(p.sm_clock_max_mhz, 500);
  EXPECT_GT(p.sm_clock_mhz, 100);
  EXPECT_LE(p.sm_clock_mhz, p.sm_clock_max_mhz);
  EXPECT_GT(p.power_limit_w, 50);
  EXPECT_LT(p.power_limit_w, 2000);  // W, not mW
  EXPECT_LT(p.sm_clock_max_mhz, 4000);
  EXPECT_GT(p.power_w, 0.4 * p.power_limit_w);  // a second of GEMMs draws near the limit (an H200: ~690 of 700 W)
  EXPECT_LE(p.power_w, 1.5 * p.power_limit_w);
  // A board at its limit has the driver's power-cap reason set (its bit read right) at least sometimes.
  if (p.power_w > 0.9 * p.power_limit_w) {
    EXPECT_GT(p.power_capped, 0.0);
  }
  EXPECT_FALSE(power_json(p).is_null());
  std::printf("[gpu power] under a GEMM loop: %s\n", p.words().c_str());
}

#endif  // DFLASH_HAVE_CUDA
