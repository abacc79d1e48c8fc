// CUDA runtime helpers of the GPU backend: error checks that throw, an owning device array, and
// bf16 <-> fp32 conversion on the device. CUDA builds only.
//
// Conventions of every kernel in src/ops/cuda: tensors are row-major in PyTorch shape order (as the
// CPU references in src/ops/cpu), activations bf16 (__nv_bfloat16), parameters / gradients /
// statistics fp32, all math in fp32; every entry point takes the stream to run on and never
// synchronizes it or touches global state, so any number of threads may call them on their own
// streams at once (no run-time compilation, no lazily built tables).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/device_info.h"

namespace dflash::cuda {

using bf16 = __nv_bfloat16;
using fp8 = uint8_t;  // one E4M3 byte (OCP FP8 "fn": largest finite 448; ops/cuda/fp8.h)

/// Throws std::runtime_error("CUDA error: <expr> at <file>:<line>: <message>") when e != cudaSuccess.
void check(cudaError_t e, const char* expr, const char* file, int line);
#define DFLASH_CUDA_CHECK(expr) ::dflash::cuda::check((expr), #expr, __FILE__, __LINE__)
/// Checks the last kernel launch (cudaGetLastError).
#define DFLASH_CUDA_CHECK_LAUNCH() ::dflash::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

/// The message of an allocation the device refused: "out of GPU memory on cuda:<device>: <asked> GB
/// asked with <free> GB free of <total> GB (<pool> GB held by the stream-ordered pool)", GB = 1e9 bytes.
std::string out_of_memory_message(int device, size_t asked, size_t free, size_t total, size_t pool_reserved);
/// As check for an allocation of `bytes`; an out-of-memory error throws std::runtime_error with
/// out_of_memory_message (the current device's numbers: callers allocate on it) and the call's
/// expression and place, instead of the bare CUDA error.
void check_alloc(cudaError_t e, size_t bytes, const char* expr, const char* file, int line);
#define DFLASH_CUDA_CHECK_ALLOC(expr, bytes) ::dflash::cuda::check_alloc((expr), (bytes), #expr, __FILE__, __LINE__)

/// True when a CUDA device is usable by this process (never throws); require_device: device_info.h.
bool has_device();

/// Owning device allocation of n elements of T (cudaMalloc / cudaFree). Move-only. Contents are
/// uninitialized unless built from host data.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) : n_(n) {
    if (n) DFLASH_CUDA_CHECK_ALLOC(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)), n * sizeof(T));
  }
  /// Copy of n host elements (synchronous on `stream`).
  DeviceArray(const T* host, size_t n, cudaStream_t stream) : DeviceArray(n) {
    if (n_) {
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(p_, host, n_ * sizeof(T), cudaMemcpyHostToDevice, stream));
      DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }
  DeviceArray(const std::vector<T>& host, cudaStream_t stream) : DeviceArray(host.data(), host.size(), stream) {}
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      if (p_) cudaFree(p_);
      p_ = o.p_, n_ = o.n_;
      o.p_ = nullptr, o.n_ = 0;
    }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  /// Copy to the host (synchronous on `stream`).
  std::vector<T> to_host(cudaStream_t stream) const {
    std::vector<T> h(n_);
    if (n_) {
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost, stream));
      DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    return h;
  }
  /// Sets every byte to `byte` (asynchronous on `stream`), e.g. 0xFF to NaN-poison float outputs.
  void fill_bytes(int byte, cudaStream_t stream) {
    if (n_) DFLASH_CUDA_CHECK(cudaMemsetAsync(p_, byte, n_ * sizeof(T), stream));
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

/// A stream-ordered temporary (cudaMallocAsync / cudaFreeAsync on `stream`, served from the
/// device's memory pool, so per-step temporaries cost no device synchronization). Move-only.
template <typename T>
class StreamBuffer {
 public:
  StreamBuffer() = default;
  StreamBuffer(size_t n, cudaStream_t stream) : n_(n), stream_(stream) {
    if (n)
      DFLASH_CUDA_CHECK_ALLOC(cudaMallocAsync(reinterpret_cast<void**>(&p_), n * sizeof(T), stream), n * sizeof(T));
  }
  ~StreamBuffer() {
    if (p_) cudaFreeAsync(p_, stream_);
  }
  StreamBuffer(StreamBuffer&& o) noexcept : p_(o.p_), n_(o.n_), stream_(o.stream_) { o.p_ = nullptr, o.n_ = 0; }
  StreamBuffer& operator=(StreamBuffer&& o) noexcept {
    if (this != &o) {
      if (p_) cudaFreeAsync(p_, stream_);
      p_ = o.p_, n_ = o.n_, stream_ = o.stream_;
      o.p_ = nullptr, o.n_ = 0;
    }
    return *this;
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
  cudaStream_t stream_ = nullptr;
};

/// A stream-ordered device copy of host values (the copy is enqueued on `stream`; pageable host
/// memory is staged before the call returns, so `v` may go away afterwards).
template <typename T>
StreamBuffer<T> upload(const std::vector<T>& v, cudaStream_t stream) {
  StreamBuffer<T> b(v.size(), stream);
  if (!v.empty())
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(b.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  return b;
}

/// Blocks of 256 threads for a grid-stride loop over n elements (at least 1, at most 262140).
inline int grid_for(int64_t n) { return int(n <= 256 ? 1 : std::min<int64_t>((n + 255) / 256, 65535 * 4)); }

/// out[i] = bf16(in[i]) (round to nearest even), n elements.
void f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream);
/// out[i] = float(in[i]), n elements.
void bf16_to_f32(const bf16* in, float* out, int64_t n, cudaStream_t stream);

}  // namespace dflash::cuda
