// The GPU infrastructure (src/gpu): architecture lists, out-of-memory reports, refused allocations.
// The GPU test skips, saying so, where no GPU is visible (CI); scripts/gpu_check.sh runs it on the GPU
// machine.
#include <gtest/gtest.h>

#ifdef DFLASH_HAVE_CUDA

#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "gpu/device_info.h"
#include "gpu/runtime.h"

using namespace dflash;
using cuda::DeviceArray;

TEST(CudaDeviceInfo, ArchitectureListsWithFeatureSuffixes) {
  // (No GPU needed.) CMake architecture lists may name Hopper's arch-specific target "90a".
  EXPECT_EQ(cuda::parse_archs("80 90a 100 120"), (std::vector<int>{80, 90, 100, 120}));
  EXPECT_EQ(cuda::parse_archs("90"), (std::vector<int>{90}));
  EXPECT_TRUE(cuda::parse_archs("").empty());
  EXPECT_THROW(cuda::parse_archs("native"), std::invalid_argument);
  // The wgmma kernels run only where an H100 / H200 surely loads the sm_90a code.
  EXPECT_TRUE(cuda::sm90a_without_sm90("80 90a 100 120"));
  EXPECT_TRUE(cuda::sm90a_without_sm90("90a-real"));
  EXPECT_FALSE(cuda::sm90a_without_sm90("80 90 100 120"));
  EXPECT_FALSE(cuda::sm90a_without_sm90("90 90a"));
  EXPECT_FALSE(cuda::sm90a_without_sm90("90-virtual 90a"));
}

TEST(CudaRuntime, OutOfMemoryMessageGivesTheNumbers) {
  // (No GPU needed.) What a refused allocation reports, in GB of 1e9 bytes.
  EXPECT_EQ(cuda::out_of_memory_message(1, size_t(2500) << 20, 800000000, 79180000000, 1500000000),
            "out of GPU memory on cuda:1: 2.62 GB asked with 0.80 GB free of 79.18 GB (1.50 GB held by the "
            "stream-ordered pool)");
}

TEST(CudaRuntime, RefusedAllocationsThrowTheMessageAndLeaveTheDeviceUsable) {
  DFLASH_REQUIRE_GPU();
  size_t free = 0, total = 0;
  DFLASH_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const size_t too_many = total / 2 + 1;  // floats: twice the device's memory
  for (const bool pooled : {false, true}) {
    cudaStream_t s;
    DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
    try {
      if (pooled) {
        const cuda::StreamBuffer<float> b(too_many, s);
      } else {
        const DeviceArray<float> a(too_many);
      }
      ADD_FAILURE() << (pooled ? "StreamBuffer" : "DeviceArray") << " of " << too_many * 4 << " bytes did not throw";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("out of GPU memory on cuda:"), std::string::npos) << m;
      EXPECT_NE(m.find(pooled ? "(cudaMallocAsync(" : "(cudaMalloc("), std::string::npos) << m;
      EXPECT_NE(m.find("runtime.h:"), std::string::npos) << m;  // the allocating call's place
    }
    DeviceArray<float> small(1024);  // the device still serves allocations and kernels
    small.fill_bytes(0, s);
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
    DFLASH_CUDA_CHECK(cudaStreamDestroy(s));
  }
}

#else

TEST(CudaRuntime, NotBuilt) { GTEST_SKIP() << "built without CUDA (DFLASH_CUDA=OFF): GPU runtime tests not compiled"; }

#endif
