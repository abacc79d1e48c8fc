// Helpers of the GPU tests: bf16-representable random inputs, host <-> device copies as bf16.
#pragma once
#ifdef DFLASH_HAVE_CUDA

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/runtime.h"
#include "tensor/dtype.h"

/// Skips the calling test, saying where GPU tests run, when no CUDA device is visible (CI has none).
#define DFLASH_REQUIRE_GPU()                                                                                 \
  do {                                                                                                       \
    if (!::dflash::cuda::has_device())                                                                       \
      GTEST_SKIP() << "no CUDA device visible: GPU test skipped (runs in scripts/gpu_check.sh)";             \
  } while (0)

namespace dflash::test {

/// The fixture of GPU test suites: each test is skipped without a device (DFLASH_REQUIRE_GPU). A
/// suite names it, `using CudaGdn = test::GpuTest;`, and its tests are TEST_F(CudaGdn, ...).
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { DFLASH_REQUIRE_GPU(); }
};
/// The same for parameterized suites (TEST_P).
template <typename P>
class GpuTestWithParam : public ::testing::TestWithParam<P> {
 protected:
  void SetUp() override { DFLASH_REQUIRE_GPU(); }
};

/// n values ~ N(0, scale^2), each exactly representable in bf16 (CPU and GPU see the same inputs).
inline std::vector<float> rand_bf16_values(size_t n, std::mt19937_64& rng, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(nd(rng)));
  return v;
}

/// The values rounded to bf16 on the device (synchronous on s).
inline cuda::DeviceArray<cuda::bf16> to_device_bf16(const std::vector<float>& v, cudaStream_t s) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  cuda::DeviceArray<cuda::bf16> d(v.size());
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(d.data(), h.data(), h.size() * 2, cudaMemcpyHostToDevice, s));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  return d;
}

/// A bf16 device array as float values on the host (synchronous on s).
inline std::vector<float> to_host_f32(const cuda::DeviceArray<cuda::bf16>& d, cudaStream_t s) {
  std::vector<uint16_t> h(d.size());
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(h.data(), d.data(), h.size() * 2, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> r(h.size());
  for (size_t i = 0; i < h.size(); ++i) r[i] = bf16_to_f32(h[i]);
  return r;
}

template <typename T>
bool all_finite(const std::vector<T>& v) {
  for (T x : v)
    if (!std::isfinite(double(x))) return false;
  return true;
}

}  // namespace dflash::test

#endif
