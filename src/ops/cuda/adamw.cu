#include <algorithm>
#include <cmath>
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

__global__ void adamw_kernel(float* p, const float* grad, float* m, float* v, bf16* pb, int64_t n, AdamWStep s,
                             const float* scale) {
  const float sc = scale ? *scale : 1.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = scale ? __fmul_rn(grad[i], sc) : grad[i];
    float pv = p[i];
    if (s.weight_decay) pv = __fmul_rn(pv, s.decay);
    // Same operation order and roundings as the CPU AdamW (no fused multiply-adds).
    const float mv = __fadd_rn(__fmul_rn(m[i], s.b1), __fmul_rn(s.one_b1, g));
    const float vv = __fadd_rn(__fmul_rn(v[i], s.b2), __fmul_rn(s.one_b2, __fmul_rn(g, g)));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), s.sqrt_bc2), s.eps);
    pv = __fsub_rn(pv, __fmul_rn(s.step_size, __fdiv_rn(mv, denom)));
    m[i] = mv;
    v[i] = vv;
    p[i] = pv;
    if (pb) pb[i] = __float2bfloat16_rn(pv);
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
  const int grid = int(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 4));
  adamw_kernel<<<grid, kThreads, 0, stream>>>(p, grad, m, v, p_bf16, n, s, grad_scale);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
