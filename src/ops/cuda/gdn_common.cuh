// Device helpers shared by the GatedDeltaNet kernels (gdn_*.cu; gated_delta_rule.h). The chunked
// forward, per chunk of L <= 64 tokens of one sequence and value head, with G_i = sum_{j<=i} g_j
// inside the chunk and S0 the state before it:
//   A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i),  T = (I + A)^-1  (blocked substitution)
//   w = T diag(beta exp(G)) K,  u = T diag(beta) V                          (kernel chunk_prepare)
//   U = u - w S0                                 (the chunk's beta_t (v_t - S_{t-1}^T k_t), all t)
//   O = diag(exp(G)) Q S0 + P U,  P_ij = exp(G_i - G_j) q_i.k_j (j <= i)
//   S = exp(G_L) S0 + (diag(exp(G_L - G)) K)^T U              (kernels chunk_state, then chunk_out)
// which unrolls the token recurrence exactly (flash-linear-attention's chunk_gated_delta_rule).
// chunk_prepare runs every (chunk, key head) in parallel, the value heads of the key head in turn;
// chunk_state walks the chunks of one sequence in order, per (sequence, value head, 32 or 64 state
// columns), and keeps only the sequential part (U and the state before each chunk); chunk_out
// computes O for every chunk in parallel (and, for a layer, its gated RMSNorm: GatedNormOut).
// Every matrix product runs on tensor cores in 3xBF16 (mma_3xbf16: fp32 values as bf16 pairs
// hi + lo, ~2^-16 relative per product; half the mma instructions of 3xTF32). chunk_state's and
// chunk_out's operands are split once, by the kernel that makes them (Split); chunk_prepare splits
// its keys, queries and values once, in place in shared memory (split_rows_in_place), and
// T diag(coef) in registers. The state and every stored activation stay fp32; bench gdn records the
// output's error against the fp32 token recurrence. The substitution for T is fp32 SIMT. The
// layer's activations between the projections' GEMMs (conv1d, q / k / v, o) are fp32 too; the
// input projections are one GEMM's bf16 output (as transformers rounds each projection), read in place.
// The kernels' files: gdn_conv.cu (conv1d + SiLU, l2norm, gates), gdn_chunk_prepare.cu,
// gdn_chunk_state_simt.cu, gdn_chunk_state_mma.cu, gdn_chunk_state_wgmma.cu, gdn_chunk_out.cu,
// gdn_gated_norm.cu; gdn_dispatch.cu picks and launches them (gdn_kernels.h). The CPU form of the
// same stages, with every intermediate: cpu::gated_delta_rule_chunked (ops/gated_delta_rule.h).
#pragma once
#include "gpu/fast_math.cuh"
#include "gpu/mma.cuh"
#include "gpu/vec.cuh"
#include "ops/cuda/gdn_kernels.h"

namespace dflash::cuda::detail {

using Chunk = GdnChunk;

/// out, a lane's 4 channels of one head's row, l2-normalized over the head's `lanes` lanes (a power of
/// two <= 32, aligned in the warp; xor shuffles, so every lane of the warp takes part) and times
/// `scale`: ConvQkNorm's l2norm (eps 1e-6), shared by conv1d_silu_kernel and chunk_prepare's conv.
__device__ __forceinline__ void l2norm_lanes(float (&out)[4], int lanes, float scale) {
  float ss = out[0] * out[0] + out[1] * out[1] + out[2] * out[2] + out[3] * out[3];
  for (int o = 1; o < lanes; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float sc = rsqrtf(ss + 1e-6f) * scale;
#pragma unroll
  for (int v = 0; v < 4; ++v) out[v] *= sc;
}

/// The sum of v over the warp's 32 lanes (every lane gets it).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// A token's gates of one value head from its b and a projections: beta = sigmoid(b), the log decay
/// g = -exp(A_log) softplus(a + dt_bias) (torch's softplus threshold 20).
__device__ __forceinline__ void gates(bf16 b, bf16 a, float A_log, float dt_bias, float& g, float& beta) {
  beta = 1.f / (1.f + expf(-__bfloat162float(b)));
  const float x = __bfloat162float(a) + dt_bias;
  const float sp = x > 20.f ? x : log1pf(expf(x));
  g = -expf(A_log) * sp;
}

/// One output of the gated RMSNorm: w x s silu(z), s = rsqrt(mean(x^2) + eps) of the row.
__device__ __forceinline__ float gated_norm(float w, float x, float s, float z) { return w * (x * s) * fast_silu(z); }

/// x0, x1 split into s.hi[i], s.hi[i + 1] and s.lo[i], s.lo[i + 1] (i even).
__device__ __forceinline__ void store_split(Split s, int64_t i, float x0, float x1) {
  mma::split_bf16x2(x0, x1, *reinterpret_cast<uint32_t*>(s.hi + i), *reinterpret_cast<uint32_t*>(s.lo + i));
}

/// Rows [0, rows) of a [T, H, n] fp32 tensor (head h, columns c0 .. c0 + ncols - 1, ncols % 4 == 0,
/// rows from `start`; token rows row_stride floats apart, 0: H n) into dst [rows][ld] with cp.async:
/// rows >= L and columns >= ncols are zero-filled (columns up to `width`, a multiple of 4, <= 128).
/// A warp per row and a lane per 16 bytes: no index division. Completes at the next cp.async wait.
__device__ __forceinline__ void load_rows_async(float* dst, int ld, int width, const float* src, int start, int L, int H,
                                                int h, int n, int c0, int ncols, int rows = kChunk,
                                                int64_t row_stride = 0) {
  const int c = 4 * (threadIdx.x % 32);
  if (c >= width) return;
  const int64_t rs = row_stride ? row_stride : int64_t(H) * n;
  const float* first = src + int64_t(start) * rs + int64_t(h) * n + c0 + c;
  for (int r = threadIdx.x / 32; r < rows; r += kThreads / 32) {
    const bool ok = r < L && c < ncols;
    mma::cp_async16(dst + r * ld + c, ok ? first + r * rs : src, ok);
  }
}

/// Rows [0, rows) of a split bf16 tensor into dst {hi, lo} x [rows][ld] (the low part lo_off elements
/// on) by cp.async: row r from src + off0 + r * stride, `width` columns (a multiple of 8, <= 128), of
/// which the first ncols (a multiple of 8) are read and the rest, like rows >= L, zero-filled. Half a
/// warp per row and a lane per 16 bytes: no index division. Completes at the next cp.async wait.
__device__ __forceinline__ void load_split_async(bf16* dst, int ld, int lo_off, Split src, int64_t stride, int64_t off0,
                                                 int L, int ncols, int width, int rows) {
  static_assert(kThreads % 32 == 0, "whole warps");
  const int lane = threadIdx.x % 32, c = 8 * (lane % 16);
  if (c >= width) return;
  for (int r = 2 * int(threadIdx.x / 32) + lane / 16; r < rows; r += kThreads / 16) {
    const bool ok = r < L && c < ncols;
    const int64_t at = ok ? off0 + r * stride + c : 0;
    mma::cp_async16(dst + r * ld + c, src.hi + at, ok);
    mma::cp_async16(dst + lo_off + r * ld + c, src.lo + at, ok);
  }
}

/// The other way: rows [0, rows) x ncols columns (a multiple of 8) of src {hi, lo} x [rows][ld] (low
/// part lo_off on, shared memory) to dst + off0 + r * stride, 16 bytes per lane: whole cache lines
/// where fragment-order stores would touch a line per row.
__device__ __forceinline__ void store_split_rows(Split dst, int64_t stride, int64_t off0, const bf16* src, int ld,
                                                 int lo_off, int rows, int ncols) {
  const int lane = threadIdx.x % 32, c = 8 * (lane % 16);
  if (c >= ncols) return;
  for (int r = 2 * int(threadIdx.x / 32) + lane / 16; r < rows; r += kThreads / 16) {
    const int64_t at = off0 + r * stride + c;
    *reinterpret_cast<uint4*>(dst.hi + at) = *reinterpret_cast<const uint4*>(src + r * ld + c);
    *reinterpret_cast<uint4*>(dst.lo + at) = *reinterpret_cast<const uint4*>(src + lo_off + r * ld + c);
  }
}

/// A tensor-core chunk_state's fp32 state in C fragments (mma.sync's layout, both forms): S[nt][e] is
/// row sm0 + g (+ 8 for e >= 2), column 8 nt + 2 t + e % 2 of the block's state columns from c0.
/// Loaded from init ([.., dk, dv] at state_off; null or !load: zeros), rows >= dk and columns >= ncols
/// zero.
template <int N>
__device__ __forceinline__ void load_state_frags(float (&S)[N][4], const float* init, bool load, int64_t state_off,
                                                 int sm0, int g, int t, int dk, int dv, int c0, int ncols) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = sm0 + g + 8 * (e / 2), col = 8 * nt + 2 * t + e % 2;
      S[nt][e] = init && load && row < dk && col < ncols ? init[state_off + int64_t(row) * dv + c0 + col] : 0.f;
    }
}

/// The other way: rows < dk, columns < ncols of the fragments to out ([.., dk, dv] at state_off).
template <int N>
__device__ __forceinline__ void store_state_frags(const float (&S)[N][4], float* out, int64_t state_off, int sm0,
                                                  int g, int t, int dk, int dv, int c0, int ncols) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = sm0 + g + 8 * half, col = 8 * nt + 2 * t;
      if (row < dk && col < ncols)
        *reinterpret_cast<float2*>(out + state_off + int64_t(row) * dv + c0 + col) =
            make_float2(S[nt][2 * half], S[nt][2 * half + 1]);
    }
}

// On sm_90+ the three kernels of the chunked rule overlap (programmatic dependent launch). The
// tensor-core chunk_state starts beside chunk_prepare's last blocks: chunk_prepare's blocks go in chunk
// order and each publishes when its chunk is in memory (a fence, then a flag, then one more in a count
// of them all), and chunk_state waits for each chunk's flag (until the count says every chunk is
// there) before loading it. chunk_out runs beside chunk_state: chunk_state lets the dependent launch start
// once all its blocks run, and publishes per block how many of its chunks' states and U are in memory
// (every kPublish chunks and after the last: a fence per publish, which the chain of chunks waits
// for); each chunk_out block waits for its chunk's before loading them. No kernel waits on a later
// one, and a dependent kernel starts only when every block of the one before it has started (or
// ended), so every wait ends.
constexpr int kPublish = 4;

/// A chunk_state block (grid (sequences, Hv, column blocks)) after chunk ci of its c_first .. c_end - 1
/// and a __syncthreads: every kPublish chunks and after the last, thread 0 makes the block's earlier
/// global writes visible, then sets its progress flag to ci + 1 (progress null: nothing).
__device__ __forceinline__ void publish_progress(int* progress, int ci, int c_first, int c_end) {
  if (!progress || threadIdx.x != 0 || ((ci - c_first) % kPublish != kPublish - 1 && ci + 1 != c_end)) return;
  int* flag = progress + (int64_t(blockIdx.x) * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z;
  __threadfence();
  asm volatile("st.relaxed.gpu.global.s32 [%0], %1;\n" ::"l"(flag), "r"(ci + 1) : "memory");
}
__device__ __forceinline__ int load_acquire(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/// A chunk_prepare block (1-D grid of chunks x Hk, chunk-major) at its end: after a __syncthreads,
/// thread 0 makes the block's global writes visible, sets prepared[block] and adds one to
/// prepared[gridDim.x] (prepared null: nothing).
__device__ __forceinline__ void publish_prepared(int* prepared) {
  if (!prepared) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  asm volatile("st.relaxed.gpu.global.s32 [%0], %1;\n" ::"l"(prepared + blockIdx.x), "r"(1) : "memory");
  atomicAdd(prepared + gridDim.x, 1);
}

/// chunk_state, every thread, before it loads chunk ci's w, k, u or gates (for key head kh of Hk):
/// waits for the chunk_prepare block of (ci, kh) to publish them, unless `all` (set here once the count
/// of prepared blocks reaches `blocks`: no more waiting). prepared null: nothing to wait for.
__device__ __forceinline__ void wait_prepared(const int* prepared, int blocks, int ci, int Hk, int kh, bool& all) {
  if (!prepared || all) return;
  if (load_acquire(prepared + blocks) == blocks) {
    all = true;
    return;
  }
  while (!load_acquire(prepared + int64_t(ci) * Hk + kh)) __nanosleep(100);
}

/// Launches kernel<<<grid, kThreads, smem, stream>>>(args...), with `programmatic` as a programmatic
/// dependent launch (it may start before the kernel ahead of it in the stream ends; see
/// publish_prepared).
template <typename... Params, typename... Args>
cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, size_t smem, cudaStream_t stream,
                                bool programmatic, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &pdl;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace dflash::cuda::detail
