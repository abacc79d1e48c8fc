#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "ops/cuda/cross_entropy.h"

namespace dflash::cuda {

namespace {

constexpr int kThreads = 512;

struct Stat {
  float m, s;  // running max and sum of exp(x - m)
  float bv;    // best value
  int bi;      // its index
};

__device__ Stat combine(Stat a, Stat b) {
  const float m = fmaxf(a.m, b.m);
  Stat r;
  r.m = m;
  r.s = (a.m == -INFINITY ? 0.f : a.s * __expf(a.m - m)) + (b.m == -INFINITY ? 0.f : b.s * __expf(b.m - m));
  const bool take_b = b.bv > a.bv || (b.bv == a.bv && b.bi < a.bi);
  r.bv = take_b ? b.bv : a.bv;
  r.bi = take_b ? b.bi : a.bi;
  return r;
}

/// Folds logit x (column c) into the running statistics.
__device__ __forceinline__ void push(Stat& st, float x, int c) {
  if (x > st.m) {
    st.s = st.s * __expf(st.m - x) + 1.f;
    st.m = x;
  } else {
    st.s += __expf(x - st.m);
  }
  if (x > st.bv) st.bv = x, st.bi = c;  // strictly greater: the first index wins per thread
}

/// Folds four consecutive logits (columns c..c+3): one rescale at most, then four exponentials.
__device__ __forceinline__ void push4(Stat& st, float4 x, int c) {
  const float m4 = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
  if (m4 > st.m) {
    st.s = st.m == -INFINITY ? 0.f : st.s * __expf(st.m - m4);
    st.m = m4;
  }
  st.s += __expf(x.x - st.m) + __expf(x.y - st.m) + __expf(x.z - st.m) + __expf(x.w - st.m);
  if (m4 > st.bv) {
    st.bv = m4;
    st.bi = x.x == m4 ? c : x.y == m4 ? c + 1 : x.z == m4 ? c + 2 : c + 3;
  }
}

// One block per row of the chunk: online softmax statistics, target logit, argmax, and (if g) the
// logit gradient coef * (softmax - onehot) in bf16. Rows are read as float4 when V % 4 == 0 (rows
// then start 16-byte aligned), two loads in flight per thread.
__global__ void __launch_bounds__(kThreads) ce_row_kernel(const float* logits, int64_t V, const int32_t* targets,
                                                          const float* coef, float* lse, float* tl, int32_t* amax,
                                                          bf16* g) {
  __shared__ Stat red[kThreads / 32];
  __shared__ float s_lse;
  const int64_t r = blockIdx.x;
  const float* L = logits + r * V;
  const bool vec = V % 4 == 0;
  Stat st{-INFINITY, 0.f, -INFINITY, INT_MAX};
  if (vec) {
    const float4* L4 = reinterpret_cast<const float4*>(L);
    const int n4 = int(V / 4);
    int c = threadIdx.x;
    for (; c + int(blockDim.x) < n4; c += 2 * blockDim.x) {
      const float4 a = L4[c], b = L4[c + blockDim.x];
      push4(st, a, 4 * c);
      push4(st, b, 4 * (c + blockDim.x));
    }
    if (c < n4) push4(st, L4[c], 4 * c);
  } else {
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) push(st, L[c], int(c));
  }
  for (int o = 16; o > 0; o >>= 1) {
    Stat other{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o),
               __shfl_xor_sync(0xffffffffu, st.bv, o), __shfl_xor_sync(0xffffffffu, st.bi, o)};
    st = combine(st, other);
  }
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    Stat t = red[0];
    for (int w = 1; w < kThreads / 32; ++w) t = combine(t, red[w]);
    const float l = t.m + logf(t.s);
    s_lse = l;
    lse[r] = l;
    amax[r] = t.bi;
    tl[r] = L[targets[r]];
  }
  if (!g) return;
  __syncthreads();
  const float cr = coef[r], l = s_lse;
  const int32_t tgt = targets[r];
  bf16* gr = g + r * V;
  auto grad = [&](float x, int64_t c) { return cr == 0.f ? 0.f : cr * (__expf(x - l) - (c == tgt ? 1.f : 0.f)); };
  if (vec) {
    const float4* L4 = reinterpret_cast<const float4*>(L);
    for (int64_t c = threadIdx.x; c < V / 4; c += blockDim.x) {
      const float4 x = L4[c];
      __nv_bfloat162 lo = __floats2bfloat162_rn(grad(x.x, 4 * c), grad(x.y, 4 * c + 1));
      __nv_bfloat162 hi = __floats2bfloat162_rn(grad(x.z, 4 * c + 2), grad(x.w, 4 * c + 3));
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&lo);
      packed.y = *reinterpret_cast<uint32_t*>(&hi);
      reinterpret_cast<uint2*>(gr)[c] = packed;
    }
  } else {
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) gr[c] = __float2bfloat16_rn(grad(L[c], c));
  }
}

}  // namespace

int64_t cross_entropy_row_chunk(int64_t V, int64_t rows, int64_t max_bytes) {
  if (V <= 0 || rows <= 0)
    throw std::invalid_argument("cross_entropy_row_chunk: V (" + std::to_string(V) + ") and rows (" +
                                std::to_string(rows) + ") must be > 0");
  const int64_t cap = std::max<int64_t>(16, max_bytes / (V * 4) / 16 * 16);
  if (rows <= cap) return rows;
  const int64_t chunks = (rows + cap - 1) / cap, even = (rows + chunks - 1) / chunks;
  const int64_t tiles = (even + 127) / 128 * 128;
  return tiles <= cap ? tiles : (even + 15) / 16 * 16;
}

int64_t cross_entropy_workspace_bytes(int64_t row_chunk, int64_t V, bool with_dh) {
  return row_chunk * V * (with_dh ? 4 + 2 : 4);
}

void cross_entropy(GemmContext& gemm, const bf16* h, const bf16* W, int64_t rows, int64_t d, int64_t V,
                   const int32_t* targets, const float* coef, int64_t row_chunk, void* workspace, CeRowStats st,
                   bf16* dh) {
  if (rows < 0 || d <= 0 || V <= 0 || V > INT_MAX || row_chunk <= 0 || (dh && !coef))
    throw std::invalid_argument("cross_entropy: bad arguments (rows " + std::to_string(rows) + ", d " +
                                std::to_string(d) + ", V " + std::to_string(V) + ", row_chunk " +
                                std::to_string(row_chunk) + ")");
  float* L = static_cast<float*>(workspace);
  bf16* G = reinterpret_cast<bf16*>(L + row_chunk * V);
  for (int64_t r0 = 0; r0 < rows; r0 += row_chunk) {
    const int64_t n = std::min(row_chunk, rows - r0);
    gemm.gemm({n, V, d, false, true}, h + r0 * d, W, L);
    ce_row_kernel<<<int(n), kThreads, 0, gemm.stream()>>>(L, V, targets + r0, dh ? coef + r0 : nullptr, st.lse + r0,
                                                           st.target_logit + r0, st.argmax + r0, dh ? G : nullptr);
    DFLASH_CUDA_CHECK_LAUNCH();
    if (dh) gemm.gemm({n, d, V, false, false}, G, W, dh + r0 * d);
  }
}

std::vector<int32_t> lm_head_argmax(GemmContext& gemm, const bf16* h, const bf16* W, int64_t rows, int64_t d,
                                    int64_t V) {
  std::vector<int32_t> r(static_cast<size_t>(std::max<int64_t>(rows, 0)));
  if (rows <= 0) return r;
  cudaStream_t s = gemm.stream();
  // Row statistics against dummy targets (0): only the argmax is kept.
  const int64_t rc = cross_entropy_row_chunk(V, rows);
  StreamBuffer<char> ws(size_t(cross_entropy_workspace_bytes(rc, V, false)), s);  // no logit gradient
  StreamBuffer<int32_t> targets(size_t(rows), s), amax(size_t(rows), s);
  StreamBuffer<float> lse(size_t(rows), s), tl(size_t(rows), s);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(targets.data(), 0, size_t(rows) * 4, s));
  cross_entropy(gemm, h, W, rows, d, V, targets.data(), nullptr, rc, ws.data(), {lse.data(), tl.data(), amax.data()},
                nullptr);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(r.data(), amax.data(), size_t(rows) * 4, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  return r;
}

}  // namespace dflash::cuda
