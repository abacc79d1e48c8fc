#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "ops/cuda/fp8.h"
#include "ops/cuda/gemm.h"

namespace dflash::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void quantize_rows_kernel(const bf16* x, int64_t rows, int64_t cols, fp8* q, float* scale) {
  __shared__ float red[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const bf16* xr = x + r * cols;
    float m = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = fabsf(__bfloat162float(xr[c]));
      m = (v > m || v != v) ? v : m;  // NaN wins
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float w = __shfl_xor_sync(0xffffffffu, m, o);
      m = (w > m || w != w) ? w : m;
    }
    __syncthreads();  // red may still be read for the previous row
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    float amax = 0.f;
    for (int i = 0; i < kThreads / 32; ++i) amax = (red[i] > amax || red[i] != red[i]) ? red[i] : amax;
    // (at least 1e-30: 1 / s stays finite for rows of tiny values)
    const float s = isinf(amax) ? NAN : amax > 0.f ? fmaxf(amax / 448.f, 1e-30f) : 1.f;
    if (threadIdx.x == 0) scale[r] = s;
    const float inv = 1.f / s;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      q[r * cols + c] = fp8(__nv_cvt_float_to_fp8(__bfloat162float(xr[c]) * inv, __NV_SATFINITE, __NV_E4M3));
  }
}

__global__ void dequantize_rows_kernel(const fp8* q, const float* scale, int64_t rows, int64_t cols, bf16* y) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(q[i]), __NV_E4M3);
    y[i] = __float2bfloat16(__half2float(__half(h)) * scale[i / cols]);
  }
}

}  // namespace

void quantize_rows_fp8(const bf16* x, int64_t rows, int64_t cols, fp8* q, float* scale, cudaStream_t stream) {
  if (rows < 0 || cols < 0) throw std::invalid_argument("quantize_rows_fp8: negative size");
  if (rows == 0) return;
  quantize_rows_kernel<<<int(std::min<int64_t>(rows, 65535)), kThreads, 0, stream>>>(x, rows, cols, q, scale);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void dequantize_rows_fp8(const fp8* q, const float* scale, int64_t rows, int64_t cols, bf16* y, cudaStream_t stream) {
  if (rows < 0 || cols < 0) throw std::invalid_argument("dequantize_rows_fp8: negative size");
  if (rows * cols == 0) return;
  dequantize_rows_kernel<<<grid_for(rows * cols), kThreads, 0, stream>>>(q, scale, rows,
                                                                                                     cols, y);
  DFLASH_CUDA_CHECK_LAUNCH();
}

std::string fp8_unsupported_reason() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return "no usable CUDA device";
  }
  static std::mutex mu;
  static std::map<int, std::string> probed;
  std::lock_guard<std::mutex> lk(mu);
  auto it = probed.find(device);
  if (it != probed.end()) return it->second;
  std::string why;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major * 10 + minor < 89) {
    why = "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
          " has no FP8 tensor cores (E4M3 products need 8.9 or newer: Ada, Hopper, Blackwell)";
  } else {
    try {  // a 16 x 16 x 16 product with per-row scales, as the target runs them
      struct OwnedStream {
        cudaStream_t s = nullptr;
        ~OwnedStream() {
          if (s) cudaStreamDestroy(s);
        }
      } st;
      DFLASH_CUDA_CHECK(cudaStreamCreate(&st.s));
      const cudaStream_t s = st.s;
      {
        DeviceArray<fp8> a(256), b(256);
        DeviceArray<float> sa(16), sb(16), c(256);
        DFLASH_CUDA_CHECK(cudaMemsetAsync(a.data(), 0, 256, s));
        DFLASH_CUDA_CHECK(cudaMemsetAsync(b.data(), 0, 256, s));
        DFLASH_CUDA_CHECK(cudaMemsetAsync(sa.data(), 0, 64, s));
        DFLASH_CUDA_CHECK(cudaMemsetAsync(sb.data(), 0, 64, s));
        GemmContext g(s, size_t(1) << 20);
        g.gemm_fp8({16, 16, 16, false, true}, a.data(), sa.data(), b.data(), sb.data(), c.data());
        DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
      }
    } catch (const std::exception& e) {
      cudaGetLastError();
      const std::string m = e.what();
      why = "cuBLASLt runs no per-row scaled E4M3 product here: " + m;
      // Only cuBLASLt's refusal lasts; another failure (out of memory, a busy device) is not cached.
      if (m.find("no algorithm") == std::string::npos && m.find("status 15") == std::string::npos) return why;
    }
  }
  probed[device] = why;
  return why;
}

}  // namespace dflash::cuda
