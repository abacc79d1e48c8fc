#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "ops/cuda/adamw.h"

namespace dflash::cuda {

namespace {

constexpr int kSumBlocks = 1024, kThreads = 256;

__global__ void sumsq_partial_kernel(const float* g, int64_t n, double* partial) {
  __shared__ double red[kThreads];
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += double(g[i]) * double(g[i]);
  red[threadIdx.x] = s;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o >>= 1) {
    if (int(threadIdx.x) < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = red[0];
}

__global__ void sum_partials_kernel(const double* partial, int blocks, double* out) {
  __shared__ double red[kThreads];
  double s = 0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) s += partial[i];
  red[threadIdx.x] = s;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o >>= 1) {
    if (int(threadIdx.x) < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = red[0];
}

__global__ void clip_kernel(const double* sumsq, double max_norm, double* norm, float* coef) {
  const double nv = sqrt(*sumsq);
  if (norm) *norm = nv;
  *coef = isfinite(nv) ? float(fmin(1.0, max_norm / (nv + 1e-6))) : __int_as_float(0x7fc00000);
}

/// One element of the AdamW update, in the same operation order and roundings as the CPU AdamW (no
/// fused multiply-adds).
__device__ __forceinline__ void adamw_element(float& p, float grad, float& m, float& v, const AdamWStep& s, bool scaled,
                                              float sc) {
  const float g = scaled ? __fmul_rn(grad, sc) : grad;
  float pv = p;
  if (s.weight_decay) pv = __fmul_rn(pv, s.decay);
  const float mv = __fadd_rn(__fmul_rn(m, s.b1), __fmul_rn(s.one_b1, g));
  const float vv = __fadd_rn(__fmul_rn(v, s.b2), __fmul_rn(s.one_b2, __fmul_rn(g, g)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), s.sqrt_bc2), s.eps);
  p = __fsub_rn(pv, __fmul_rn(s.step_size, __fdiv_rn(mv, denom)));
  m = mv;
  v = vv;
}

/// Elements [0, 4 * n4) four at a time (16-byte loads and stores; the caller checked the alignment),
/// the rest one at a time. The update is bandwidth bound: 30 bytes per parameter.
__global__ void adamw_kernel(float* p, const float* grad, float* m, float* v, bf16* pb, int64_t n, int64_t n4,
                             AdamWStep s, const float* scale) {
  const float sc = scale ? *scale : 1.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < n4; i += stride) {
    float4 pv = reinterpret_cast<const float4*>(p)[i], mv = reinterpret_cast<const float4*>(m)[i];
    float4 vv = reinterpret_cast<const float4*>(v)[i];
    const float4 gv = reinterpret_cast<const float4*>(grad)[i];
    adamw_element(pv.x, gv.x, mv.x, vv.x, s, scale != nullptr, sc);
    adamw_element(pv.y, gv.y, mv.y, vv.y, s, scale != nullptr, sc);
    adamw_element(pv.z, gv.z, mv.z, vv.z, s, scale != nullptr, sc);
    adamw_element(pv.w, gv.w, mv.w, vv.w, s, scale != nullptr, sc);
    reinterpret_cast<float4*>(p)[i] = pv;
    reinterpret_cast<float4*>(m)[i] = mv;
    reinterpret_cast<float4*>(v)[i] = vv;
    if (pb) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(pv.x, pv.y), hi = __floats2bfloat162_rn(pv.z, pv.w);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&lo);
      packed.y = *reinterpret_cast<const uint32_t*>(&hi);
      reinterpret_cast<uint2*>(pb)[i] = packed;
    }
  }
  for (int64_t i = 4 * n4 + first; i < n; i += stride) {
    adamw_element(p[i], grad[i], m[i], v[i], s, scale != nullptr, sc);
    if (pb) pb[i] = __float2bfloat16_rn(p[i]);
  }
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __fmul_rn(x[i], s);
}

}  // namespace

void scale_inplace(float* x, float s, int64_t n, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("scale_inplace: negative size");
  if (n == 0) return;
  scale_kernel<<<int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 4)), kThreads, 0, stream>>>(x, s, n);
  DFLASH_CUDA_CHECK_LAUNCH();
}

int64_t grad_sumsq_workspace_doubles() { return kSumBlocks; }

void grad_sumsq(const float* g, int64_t n, double* out, double* workspace, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("grad_sumsq: negative size");
  sumsq_partial_kernel<<<kSumBlocks, kThreads, 0, stream>>>(g, n, workspace);
  DFLASH_CUDA_CHECK_LAUNCH();
  sum_partials_kernel<<<1, kThreads, 0, stream>>>(workspace, kSumBlocks, out);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void clip_coefficient(const double* sumsq, double max_norm, double* norm, float* coef, cudaStream_t stream) {
  clip_kernel<<<1, 1, 0, stream>>>(sumsq, max_norm, norm, coef);
  DFLASH_CUDA_CHECK_LAUNCH();
}

AdamWStep adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t t) {
  if (t < 1) throw std::invalid_argument("adamw_scalars: step must be >= 1");
  AdamWStep s;
  const double bc1 = 1.0 - std::pow(beta1, double(t)), bc2 = 1.0 - std::pow(beta2, double(t));
  s.b1 = float(beta1), s.b2 = float(beta2);
  s.one_b1 = float(1.0 - beta1), s.one_b2 = float(1.0 - beta2);
  s.step_size = float(lr / bc1), s.sqrt_bc2 = float(std::sqrt(bc2)), s.eps = float(eps);
  s.decay = float(1.0 - lr * weight_decay);
  s.weight_decay = weight_decay != 0.0;
  return s;
}

void adamw_update(float* p, const float* grad, float* m, float* v, bf16* p_bf16, int64_t n, const AdamWStep& s,
                  const float* grad_scale, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("adamw_update: negative size");
  if (n == 0) return;
  auto aligned = [](const void* x, uintptr_t a) { return reinterpret_cast<uintptr_t>(x) % a == 0; };
  const bool vec = aligned(p, 16) && aligned(grad, 16) && aligned(m, 16) && aligned(v, 16) && aligned(p_bf16, 8);
  const int64_t n4 = vec ? n / 4 : 0;
  const int grid = int(std::min<int64_t>((std::max<int64_t>(n4, n - 4 * n4) + kThreads - 1) / kThreads, 65535 * 4));
  adamw_kernel<<<grid, kThreads, 0, stream>>>(p, grad, m, v, p_bf16, n, n4, s, grad_scale);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
