#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "gpu/fast_math.cuh"
#include "gpu/vec.cuh"
#include "ops/cuda/elementwise.h"

namespace dflash::cuda {

namespace {

/// Packs of 8 when every pointer is 16-byte aligned, else 0 (all elements take the scalar tail).
template <typename... P>
int64_t packs_of(int64_t n, const P*... p) {
  return aligned_to(16, p...) ? n / 8 : 0;
}

#define DFLASH_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// The bf16 maps below read and write 8 elements (16 bytes) per thread and step when every pointer is
// 16-byte aligned ("packs" of 8), then finish the tail (or everything, when unaligned) one by one.
#define DFLASH_TAIL_STRIDE(i, from, n)                                                                  \
  for (int64_t i = (from) + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

__device__ __forceinline__ float silu_mul(float g, float u) { return fast_silu(g) * u; }
__device__ __forceinline__ void silu_mul_grad(float g, float u, float d, float& dg, float& du) {
  const float s = fast_sigmoid(g);
  dg = d * u * s * (1.f + g * (1.f - s));
  du = d * g * s;
}

// SwiGLU over gate_up [rows, 2n] (each row: gate | up, one GEMM's output), act / dact [rows, n].
// kVec elements per access: 8 (16 bytes) when n % 8 == 0 and every pointer is 16-byte aligned, else 1.
template <int kVec>
__device__ __forceinline__ void load_v(const bf16* p, float (&f)[kVec]) {
  if constexpr (kVec == 8) load8(p, f);
  else f[0] = __bfloat162float(*p);
}
template <int kVec>
__device__ __forceinline__ void store_v(bf16* p, const float (&f)[kVec]) {
  if constexpr (kVec == 8) store8(p, f);
  else *p = __float2bfloat16_rn(f[0]);
}

// A thread per kVec columns, rows from blockIdx.y on (gridDim.y apart): no index division.
template <int kVec>
__global__ void swiglu_fwd_kernel(const bf16* gu, bf16* a, int64_t rows, int64_t n) {
  const int64_t c = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * kVec;
  if (c >= n) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float G[kVec], U[kVec], A[kVec];
    load_v(gu + r * 2 * n + c, G), load_v(gu + r * 2 * n + n + c, U);
#pragma unroll
    for (int k = 0; k < kVec; ++k) A[k] = silu_mul(G[k], U[k]);
    store_v(a + r * n + c, A);
  }
}

template <int kVec>
__global__ void swiglu_bwd_kernel(bf16* gu, const bf16* da, int64_t rows, int64_t n) {
  const int64_t c = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * kVec;
  if (c >= n) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    bf16 *g = gu + r * 2 * n + c, *u = g + n;
    float G[kVec], U[kVec], D[kVec], DG[kVec], DU[kVec];
    load_v(g, G), load_v(u, U), load_v(da + r * n + c, D);
#pragma unroll
    for (int k = 0; k < kVec; ++k) silu_mul_grad(G[k], U[k], D[k], DG[k], DU[k]);
    store_v(g, DG), store_v(u, DU);  // in place: this thread read both before
  }
}

/// The grid of the SwiGLU kernels: blocks of 256 threads across a row's n / kVec accesses, rows on y.
dim3 swiglu_grid(int64_t rows, int64_t accesses) {
  return dim3(unsigned((accesses + 255) / 256), unsigned(std::min<int64_t>(rows, 65535)));
}

// Row copies move W words: uint4 (8 bf16) when the row length and every pointer allow, else bf16.
template <typename W>
__device__ __forceinline__ W nan_word() {
  if constexpr (sizeof(W) == 16) return make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);  // bf16 NaNs
  else return __float2bfloat16_rn(__int_as_float(0x7fc00000));
}

template <typename W>
__global__ void gather_kernel(const bf16* table, int64_t V, int64_t d, const int32_t* ids, int64_t rows, bf16* out,
                              int* bad) {
  const int64_t dw = d * int64_t(sizeof(bf16)) / int64_t(sizeof(W));  // words per row
  DFLASH_GRID_STRIDE(i, rows * dw) {
    const int64_t r = i / dw;
    const int32_t id = ids[r];
    if (id < 0 || id >= V) {
      reinterpret_cast<W*>(out)[i] = nan_word<W>();
      if (bad) *bad = 1;
    } else {
      reinterpret_cast<W*>(out)[i] = reinterpret_cast<const W*>(table)[int64_t(id) * dw + (i - r * dw)];
    }
  }
}

__global__ void add_kernel(bf16* y, const bf16* x, int64_t n, int64_t packs) {
  DFLASH_GRID_STRIDE(p, packs) {
    float Y[8], X[8];
    load8(y + 8 * p, Y), load8(x + 8 * p, X);
#pragma unroll
    for (int k = 0; k < 8; ++k) Y[k] += X[k];
    store8(y + 8 * p, Y);
  }
  DFLASH_TAIL_STRIDE(i, 8 * packs, n) y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + __bfloat162float(x[i]));
}

template <typename W>
__global__ void scatter_kernel(const bf16* rows, int64_t n, int64_t d, const int32_t* ids, bf16* out) {
  const int64_t dw = d * int64_t(sizeof(bf16)) / int64_t(sizeof(W));
  DFLASH_GRID_STRIDE(i, n * dw) {
    const int64_t r = i / dw;
    reinterpret_cast<W*>(out)[int64_t(ids[r]) * dw + (i - r * dw)] = reinterpret_cast<const W*>(rows)[i];
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__global__ void normal_kernel(T* x, int64_t n, uint64_t seed, float mean, float sd) {
  DFLASH_GRID_STRIDE(i, n) {
    const uint64_t h = splitmix64(seed ^ splitmix64(uint64_t(i)));
    const float u1 = (float(uint32_t(h >> 40)) + 0.5f) * 0x1.0p-24f, u2 = float(uint32_t(h & 0xFFFFFF)) * 0x1.0p-24f;
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    x[i] = T(mean + sd * z);
  }
}

__global__ void nonfinite_kernel(const uint16_t* x, int64_t n, int* flag) {
  bool bad = false;
  DFLASH_GRID_STRIDE(i, n) bad = bad || (x[i] & 0x7F80u) == 0x7F80u;  // exponent all ones: Inf or NaN
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

}  // namespace

void flag_nonfinite(const bf16* x, int64_t n, int* flag, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("flag_nonfinite: negative size");
  if (n == 0) return;
  nonfinite_kernel<<<grid_for(n), 256, 0, stream>>>(reinterpret_cast<const uint16_t*>(x), n, flag);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void fill_normal(float* x, int64_t n, uint64_t seed, float mean, float sd, cudaStream_t stream) {
  if (n <= 0) return;
  normal_kernel<float><<<grid_for(n), 256, 0, stream>>>(x, n, seed, mean, sd);
  DFLASH_CUDA_CHECK_LAUNCH();
}
void fill_normal(bf16* x, int64_t n, uint64_t seed, float mean, float sd, cudaStream_t stream) {
  if (n <= 0) return;
  normal_kernel<bf16><<<grid_for(n), 256, 0, stream>>>(x, n, seed, mean, sd);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void swiglu_forward(const bf16* gate_up, int64_t rows, int64_t n, bf16* act, cudaStream_t stream) {
  if (rows < 0 || n < 0) throw std::invalid_argument("swiglu_forward: negative size");
  if (rows == 0 || n == 0) return;
  if (n % 8 == 0 && aligned_to(16, gate_up, act))
    swiglu_fwd_kernel<8><<<swiglu_grid(rows, n / 8), 256, 0, stream>>>(gate_up, act, rows, n);
  else
    swiglu_fwd_kernel<1><<<swiglu_grid(rows, n), 256, 0, stream>>>(gate_up, act, rows, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(bf16* gate_up, const bf16* dact, int64_t rows, int64_t n, cudaStream_t stream) {
  if (rows < 0 || n < 0) throw std::invalid_argument("swiglu_backward: negative size");
  if (rows == 0 || n == 0) return;
  if (n % 8 == 0 && aligned_to(16, gate_up, dact))
    swiglu_bwd_kernel<8><<<swiglu_grid(rows, n / 8), 256, 0, stream>>>(gate_up, dact, rows, n);
  else
    swiglu_bwd_kernel<1><<<swiglu_grid(rows, n), 256, 0, stream>>>(gate_up, dact, rows, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void embedding_gather(const bf16* table, int64_t V, int64_t d, const int32_t* ids, int64_t rows, bf16* out, int* bad_id,
                      cudaStream_t stream) {
  if (V <= 0 || d <= 0 || rows < 0) throw std::invalid_argument("embedding_gather: bad sizes");
  if (rows == 0) return;
  if (d % 8 == 0 && aligned_to(16, table, out))
    gather_kernel<uint4><<<grid_for(rows * d / 8), 256, 0, stream>>>(table, V, d, ids, rows, out, bad_id);
  else
    gather_kernel<bf16><<<grid_for(rows * d), 256, 0, stream>>>(table, V, d, ids, rows, out, bad_id);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void scatter_rows(const bf16* rows, int64_t n, int64_t d, const int32_t* ids, bf16* out, cudaStream_t stream) {
  if (n < 0 || d <= 0) throw std::invalid_argument("scatter_rows: bad sizes");
  if (n == 0) return;
  if (d % 8 == 0 && aligned_to(16, rows, out))
    scatter_kernel<uint4><<<grid_for(n * d / 8), 256, 0, stream>>>(rows, n, d, ids, out);
  else
    scatter_kernel<bf16><<<grid_for(n * d), 256, 0, stream>>>(rows, n, d, ids, out);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void add_inplace(bf16* y, const bf16* x, int64_t n, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("add_inplace: negative size");
  if (n == 0) return;
  const int64_t packs = packs_of(n, y, x);
  add_kernel<<<grid_for(std::max(packs, n - 8 * packs)), 256, 0, stream>>>(y, x, n, packs);
  DFLASH_CUDA_CHECK_LAUNCH();
}

__global__ void mul_sigmoid_kernel(bf16* y, const bf16* gate, int64_t n, int64_t packs) {
  DFLASH_GRID_STRIDE(p, packs) {
    float Y[8], G[8];
    load8(y + 8 * p, Y), load8(gate + 8 * p, G);
#pragma unroll
    for (int k = 0; k < 8; ++k) Y[k] *= fast_sigmoid(G[k]);
    store8(y + 8 * p, Y);
  }
  DFLASH_TAIL_STRIDE(i, 8 * packs, n)
  y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) * fast_sigmoid(__bfloat162float(gate[i])));
}

void mul_sigmoid(bf16* y, const bf16* gate, int64_t n, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("mul_sigmoid: negative size");
  if (n == 0) return;
  const int64_t packs = packs_of(n, y, gate);
  mul_sigmoid_kernel<<<grid_for(std::max(packs, n - 8 * packs)), 256, 0, stream>>>(y, gate, n, packs);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
