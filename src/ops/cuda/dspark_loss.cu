// DSpark's loss kernels (dspark_loss.h): one block per row, three passes over the vocabulary (softmax
// statistics of z and t, then L1 and the confidence dot product, then the logit gradient).
#include <climits>
#include <stdexcept>
#include <string>

#include "ops/cuda/dspark_loss.h"

namespace dflash::cuda {

namespace {

constexpr int kThreads = 256;

/// Running max and sum of exp(x - max).
struct MaxSum {
  float m = -INFINITY, s = 0.f;
  __device__ void push(float x) {
    if (x > m) {
      s = (m == -INFINITY ? 0.f : s * __expf(m - x)) + 1.f;
      m = x;
    } else {
      s += __expf(x - m);
    }
  }
  __device__ static MaxSum combine(MaxSum a, MaxSum b) {
    MaxSum r;
    r.m = fmaxf(a.m, b.m);
    r.s = (a.m == -INFINITY ? 0.f : a.s * __expf(a.m - r.m)) + (b.m == -INFINITY ? 0.f : b.s * __expf(b.m - r.m));
    return r;
  }
};

template <int N>
__device__ void block_sum(float (&v)[N], float (*sh)[kThreads / 32]) {
  for (int o = 16; o > 0; o >>= 1)
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  __syncthreads();
  if (threadIdx.x % 32 == 0)
    for (int i = 0; i < N; ++i) sh[i][threadIdx.x / 32] = v[i];
  __syncthreads();
  for (int i = 0; i < N; ++i) {
    float t = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) t += sh[i][w];
    v[i] = t;
  }
}

__global__ void __launch_bounds__(kThreads) dspark_row_kernel(const float* z_all, const float* t_all, int64_t V,
                                                              const int32_t* labels, const float* coef, const bf16* h,
                                                              const bf16* e, int64_t d, int64_t rk, const float* cw,
                                                              const float* cb, DSparkRowStats st, bf16* dz) {
  __shared__ MaxSum sz[kThreads / 32], stt[kThreads / 32];
  __shared__ float sbv[kThreads / 32];
  __shared__ int sbi[kThreads / 32];
  __shared__ float sums[3][kThreads / 32];
  const int64_t r = blockIdx.x;
  const float* z = z_all + r * V;
  const float* t = t_all + r * V;
  // Pass 1: softmax statistics of z and t, argmax of z.
  MaxSum a, b;
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int64_t c = threadIdx.x; c < V; c += kThreads) {
    const float x = z[c];
    a.push(x);
    b.push(t[c]);
    if (x > bv) bv = x, bi = int(c);
  }
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum oa{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
    MaxSum ob{__shfl_xor_sync(0xffffffffu, b.m, o), __shfl_xor_sync(0xffffffffu, b.s, o)};
    a = MaxSum::combine(a, oa), b = MaxSum::combine(b, ob);
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
  }
  if (threadIdx.x % 32 == 0) sz[threadIdx.x / 32] = a, stt[threadIdx.x / 32] = b, sbv[threadIdx.x / 32] = bv, sbi[threadIdx.x / 32] = bi;
  __syncthreads();
  MaxSum za = sz[0], tb = stt[0];
  float best = sbv[0];
  int besti = sbi[0];
  for (int w = 1; w < kThreads / 32; ++w) {
    za = MaxSum::combine(za, sz[w]), tb = MaxSum::combine(tb, stt[w]);
    if (sbv[w] > best || (sbv[w] == best && sbi[w] < besti)) best = sbv[w], besti = sbi[w];
  }
  const float lz = za.m + logf(za.s), lt = tb.m + logf(tb.s);
  // Pass 2: L1, sum s p, and the confidence logit w_c . [h ; e].
  float v[3] = {0.f, 0.f, 0.f};
  for (int64_t c = threadIdx.x; c < V; c += kThreads) {
    const float p = __expf(z[c] - lz), q = __expf(t[c] - lt), diff = p - q;
    v[0] += fabsf(diff);
    v[1] += diff > 0.f ? p : diff < 0.f ? -p : 0.f;
  }
  for (int64_t j = threadIdx.x; j < d + rk; j += kThreads)
    v[2] += cw[j] * (j < d ? __bfloat162float(h[r * d + j]) : __bfloat162float(e[r * rk + (j - d)]));
  block_sum(v, sums);
  const float l1 = v[0], sp = v[1], c = v[2] + cb[0];
  const float y = fminf(fmaxf(1.f - 0.5f * l1, 0.f), 1.f);
  const int32_t label = labels[r];
  const float cr = coef[r];
  if (threadIdx.x == 0) {
    st.ce[r] = lz - z[label];
    st.l1[r] = l1;
    st.bce[r] = fmaxf(c, 0.f) - c * y + log1pf(__expf(-fabsf(c)));
    st.argmax[r] = besti;
    st.dc[r] = cr * (1.f / (1.f + __expf(-c)) - y);
  }
  if (!dz) return;
  // Pass 3: the logit gradient.
  bf16* g = dz + r * V;
  for (int64_t col = threadIdx.x; col < V; col += kThreads) {
    const float p = __expf(z[col] - lz), diff = p - __expf(t[col] - lt);
    const float s = diff > 0.f ? 1.f : diff < 0.f ? -1.f : 0.f;
    g[col] = __float2bfloat16_rn(cr == 0.f ? 0.f : cr * (0.1f * (p - (col == label ? 1.f : 0.f)) + 0.9f * p * (s - sp)));
  }
}

__global__ void dspark_heads_backward_kernel(const float* dc, const bf16* h, const bf16* e, const int32_t* prev,
                                             int64_t d, int64_t rk, const float* cw, const float* dh_lm,
                                             const float* de_lm, bf16* dh, float* dW1, float* dcw, float* dcb) {
  const int64_t r = blockIdx.x;
  const float g = dc[r];
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    dh[r * d + j] = __float2bfloat16_rn(dh_lm[r * d + j] + g * cw[j]);
    if (g != 0.f) atomicAdd(dcw + j, g * __bfloat162float(h[r * d + j]));
  }
  for (int64_t j = threadIdx.x; j < rk; j += blockDim.x) {
    atomicAdd(dW1 + int64_t(prev[r]) * rk + j, de_lm[r * rk + j] + g * cw[d + j]);
    if (g != 0.f) atomicAdd(dcw + d + j, g * __bfloat162float(e[r * rk + j]));
  }
  if (threadIdx.x == 0 && g != 0.f) atomicAdd(dcb, g);
}

}  // namespace

void dspark_rows(const float* z, const float* t, int64_t rows, int64_t V, const int32_t* labels, const float* coef,
                 const bf16* h, const bf16* e, int64_t d, int64_t rk, const float* cw, const float* cb, DSparkRowStats st,
                 bf16* dz, cudaStream_t stream) {
  if (rows < 0 || V <= 0 || V > INT_MAX || d <= 0 || rk <= 0 || !st.ce || !st.l1 || !st.bce || !st.argmax || !st.dc)
    throw std::invalid_argument("dspark_rows: bad arguments (rows " + std::to_string(rows) + ", V " + std::to_string(V) + ")");
  if (rows == 0) return;
  dspark_row_kernel<<<unsigned(rows), kThreads, 0, stream>>>(z, t, V, labels, coef, h, e, d, rk, cw, cb, st, dz);
  DFLASH_CUDA_CHECK(cudaGetLastError());
}

void dspark_heads_backward(const float* dc, const bf16* h, const bf16* e, const int32_t* prev, int64_t rows, int64_t d,
                           int64_t rk, const float* cw, const float* dh_lm, const float* de_lm, bf16* dh, float* dW1,
                           float* dcw, float* dcb, cudaStream_t stream) {
  if (rows < 0 || d <= 0 || rk <= 0) throw std::invalid_argument("dspark_heads_backward: bad sizes");
  if (rows == 0) return;
  dspark_heads_backward_kernel<<<unsigned(rows), 256, 0, stream>>>(dc, h, e, prev, d, rk, cw, dh_lm, de_lm, dh, dW1,
                                                                   dcw, dcb);
  DFLASH_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dflash::cuda
