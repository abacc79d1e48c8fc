// GatedDeltaNet kernels (see gated_delta_rule.h). The chunked forward, per chunk of L <= 64 tokens of
// one sequence and value head, with G_i = sum_{j<=i} g_j inside the chunk and S0 the state before it:
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
#include <algorithm>
#include <stdexcept>
#include <string>

#include "ops/cuda/fast_math.cuh"
#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/vec.cuh"
#include "ops/cuda/wgmma.cuh"
#include "ops/cuda/device_info.h"

namespace dflash::cuda {

namespace {

constexpr int kChunk = 64;      // tokens per chunk
constexpr int kMaxCols = 64;    // state columns (value features) per chunk_state block: 32 or 64
constexpr int kThreads = 256;

/// Padded key dim of the split operands (whole 16-row tiles of the 3xBF16 products; padding zero).
__host__ __device__ constexpr int state_rows(int dk) { return (dk + 15) / 16 * 16; }
/// Padded value dim of the split H and U (16-byte rows).
__host__ __device__ constexpr int value_cols(int dv) { return (dv + 7) / 8 * 8; }

constexpr int kConvRun = 16;  // tokens per thread in the conv: each input is read from memory once

/// V = 1 or 4 consecutive bf16 as floats (V = 4: one 8-byte load, vec.cuh's load4).
template <int V>
__device__ __forceinline__ void load_bf16(const bf16* p, float (&out)[V]) {
  static_assert(V == 1 || V == 4, "one channel or four");
  if constexpr (V == 4)
    load4(p, out);
  else
    out[0] = __bfloat162float(*p);
}

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

/// A thread per (V channels, run of kConvRun tokens): the last K inputs of its channels slide through
/// registers. Rows before row_start[t] count as zero (the same sum, term by term, as the CPU
/// reference). V = 4 needs C and x_stride multiples of 4, x 8-byte and y 16-byte aligned. kNorm (V =
/// 4, qk.dk / 4 a power of two <= 32: a head is an aligned group of lanes, every lane of the warp
/// taking part in the sums): the query / key heads' outputs l2-normalized to qk.q / qk.k instead of y.
template <int K, int V, bool kNorm>
__global__ void conv1d_silu_kernel(const bf16* __restrict__ x, int64_t x_stride, const float* __restrict__ w,
                                   const int32_t* __restrict__ row_start, int64_t T, int64_t C, float* __restrict__ y,
                                   ConvQkNorm qk) {
  static_assert(!kNorm || V == 4, "the fused l2norm takes four channels per lane");
  const int64_t c = (blockIdx.y * int64_t(blockDim.x) + threadIdx.x) * V, t0 = int64_t(blockIdx.x) * kConvRun;
  const bool live = c < C;
  if (!kNorm && !live) return;  // (kNorm: every lane stays for the sums)
  const int64_t q_ch = int64_t(qk.Hk) * qk.dk;
  float wk[V][K], win[K][V];  // at token t: win[j] = x[t - K + 1 + j, c ..]; before the first, x[t0 - K + j, c ..]
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) wk[v][j] = live ? w[(c + v) * K + j] : 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int64_t src = t0 - K + j;
    if (src >= 0 && live) {
      load_bf16<V>(x + src * x_stride + c, win[j]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) win[j][v] = 0.f;
    }
  }
  const int64_t t_end = t0 + kConvRun < T ? t0 + kConvRun : T;
  for (int64_t t = t0; t < t_end; ++t) {
#pragma unroll
    for (int j = 0; j + 1 < K; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) win[j][v] = win[j + 1][v];
    if (live) load_bf16<V>(x + t * x_stride + c, win[K - 1]);
    const int64_t b = row_start[t];
    float out[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (t - K + 1 + j >= b) acc += wk[v][j] * win[j][v];
      out[v] = fast_silu(acc);
    }
    if constexpr (kNorm) {  // every lane takes part in the head's sums (a head's lanes are aligned)
      const bool is_q = c < q_ch;
      float nrm[4] = {out[0], out[1], out[2], out[3]};
      l2norm_lanes(nrm, qk.dk / 4, is_q ? qk.q_scale : 1.f);
      if (c < 2 * q_ch) {
        float* dst = is_q ? qk.q + t * q_ch + c : qk.k + t * q_ch + (c - q_ch);
        *reinterpret_cast<float4*>(dst) = make_float4(nrm[0], nrm[1], nrm[2], nrm[3]);
        continue;
      }
      if (!live) continue;
    }
    if constexpr (V == 4) {
      *reinterpret_cast<float4*>(y + t * C + c) = make_float4(out[0], out[1], out[2], out[3]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) y[t * C + c + v] = out[v];
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Token t's query and key heads of row (q | k ..., fp32), a warp per head of the block:
/// q = scale l2norm, k = l2norm into q / k [T, Hk, dk] (dk <= 256).
__device__ __forceinline__ void l2norm_heads(const float* row, int64_t t, int Hk, int dk, float scale, float* q,
                                             float* k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  for (int r = warp; r < 2 * Hk; r += nwarps) {  // r < Hk: q head r; else k head r - Hk
    const float* src = row + int64_t(r) * dk;
    float x[8], ss = 0.f;  // dk <= 256: 8 values per lane
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = lane + 32 * e;
      x[e] = i < dk ? src[i] : 0.f;
      ss += x[e] * x[e];
    }
    ss = warp_sum(ss);
    const float s = rsqrtf(ss + 1e-6f) * (r < Hk ? scale : 1.f);
    float* dst = r < Hk ? q + (t * Hk + r) * dk : k + (t * Hk + r - Hk) * dk;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = lane + 32 * e;
      if (i < dk) dst[i] = x[e] * s;
    }
  }
}

/// One block per token of a [T, C] conv output: l2norm_heads (the unfused ConvQkNorm).
__global__ void qk_l2norm_kernel(const float* y, int64_t C, ConvQkNorm qk) {
  l2norm_heads(y + blockIdx.x * C, blockIdx.x, qk.Hk, qk.dk, qk.q_scale, qk.q, qk.k);
}

/// A token's gates of one value head from its b and a projections: beta = sigmoid(b), the log decay
/// g = -exp(A_log) softplus(a + dt_bias) (torch's softplus threshold 20).
__device__ __forceinline__ void gates(bf16 b, bf16 a, float A_log, float dt_bias, float& g, float& beta) {
  beta = 1.f / (1.f + expf(-__bfloat162float(b)));
  const float x = __bfloat162float(a) + dt_bias;
  const float sp = x > 20.f ? x : log1pf(expf(x));
  g = -expf(A_log) * sp;
}

/// One block per token: the q / k heads (l2norm_heads, unless q is null), then v and the gates.
__global__ void gdn_prepare_kernel(const float* qkv, const bf16* b, const bf16* a, int64_t ba_stride,
                                   const float* A_log, const float* dt_bias, int Hk, int Hv, int dk, int dv,
                                   float scale, float* q, float* k, float* v, float* g, float* beta) {
  const int64_t t = blockIdx.x, C = 2 * int64_t(Hk) * dk + int64_t(Hv) * dv;
  const float* row = qkv + t * C;
  if (q) l2norm_heads(row, t, Hk, dk, scale, q, k);
  const float* vs = row + 2 * int64_t(Hk) * dk;
  if (v)
    for (int i = threadIdx.x; i < Hv * dv; i += blockDim.x) v[t * Hv * dv + i] = vs[i];
  for (int h = threadIdx.x; h < Hv; h += blockDim.x) {
    const int64_t i = t * Hv + h, j = t * ba_stride + h;
    gates(b[j], a[j], A_log[h], dt_bias[h], g[i], beta[i]);
  }
}

using Chunk = GdnChunk;

/// fp32 values kept as two bf16 buffers of the same shape, x ~ hi + lo (split_bf16x2): the operands
/// of the 3xBF16 products, split once by the kernel that makes them.
struct Split {
  bf16* hi;
  bf16* lo;
};

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

/// Row stride (floats) of chunk_prepare's key and query / value tiles: a multiple of 32 plus 4, so
/// that a row also holds its split (split_rows_in_place) with conflict-free ldmatrix rows.
__host__ __device__ constexpr int prepare_ld(int dk, int dv) {
  const int w = state_rows(dk) > state_rows(dv) ? state_rows(dk) : state_rows(dv);
  return (w + 31) / 32 * 32 + 4;
}

/// The N fp32 tiles x[n] [64][ld] (shared memory, ld % 32 == 4), columns [0, width) (even, <= 128),
/// each rewritten in place as its split (split_bf16x2): row r's high parts from bf16 offset 2 ld r,
/// its low parts from 2 ld r + ld + 4 (each row stays in its own bytes; as a split matrix: row stride
/// 2 ld, low part ld + 4 on, rows 16-byte aligned, ldmatrix free of bank conflicts). Two rounds of
/// 32 rows, 8 threads per row; synchronizes the block.
template <int N>
__device__ __forceinline__ void split_rows_in_place(float* const (&x)[N], int ld, int width) {
  static_assert(kThreads == 256, "32 rows of 8 threads per round");
  const int rr = threadIdx.x / 8, c0 = 2 * (threadIdx.x % 8);
  for (int r0 = 0; r0 < kChunk; r0 += 32) {
    const int r = r0 + rr;
    float2 v[N][8];
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (c0 + 16 * i < width) v[n][i] = *reinterpret_cast<const float2*>(x[n] + r * ld + c0 + 16 * i);
    __syncthreads();  // every read of these rows is done
#pragma unroll
    for (int n = 0; n < N; ++n) {
      bf16* b = reinterpret_cast<bf16*>(x[n]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = c0 + 16 * i;
        if (c < width)
          mma::split_bf16x2(v[n][i].x, v[n][i].y, *reinterpret_cast<uint32_t*>(b + 2 * r * ld + c),
                            *reinterpret_cast<uint32_t*>(b + 2 * r * ld + ld + 4 + c));
      }
    }
    __syncthreads();
  }
}

/// out[i][c] = sum_{j <= i, j < L} M[i][j] coef[j] X[j][c] for i < L, c < n (n % 4 == 0, n <= 128) with
/// M lower triangular (its tiles above the diagonal are not read) on tensor cores in 3xBF16, handed
/// over in pairs: put(row(i), c, out[i][c], out[i][c + 1]) for even c. A = M diag(coef) is split in
/// registers (M [64][ldm] fp32, ldm even); X is split already (split_rows_in_place: row stride ldx,
/// low part lo_off on), its fragments loaded by ldmatrix, with zero columns from n to n rounded up to
/// 16 and zero rows (or coef, or M's columns) from L to L rounded up to 16. The triangle's 10 tiles of
/// 16 rows x 16 k are shared evenly: warp w computes the row tiles w % 2 and 3 - w % 2 (1 + 4 or 2 + 3
/// k steps) x the 16-column tiles w / 2 and w / 2 + 4.
template <typename Row, typename Put>
__device__ __forceinline__ void lower_times_rows(const float* M, int ldm, const float* coef, const bf16* X, int ldx,
                                                 int lo_off, int L, int n, Row row, Put put) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int ct = warp / 2, tiles = (n + 15) / 16;
#pragma unroll 1
  for (int s = 0; s < 2; ++s) {
    const int mt = 16 * (s ? 3 - warp % 2 : warp % 2);
    float acc[4][4] = {};  // n-tile 2 q + e: columns 16 (ct + 4 q) + 8 e ..
    for (int j0 = 0; j0 < L && j0 <= mt; j0 += 16) {  // M's tiles on and below the diagonal
      uint32_t ah[4], al[4];
      const int j = j0 + 2 * t;
      const float f0 = coef[j], f1 = coef[j + 1], f8 = coef[j + 8], f9 = coef[j + 9];
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // a[half] rows g (+ 8), columns j, j + 1; a[2 + half]: j + 8, j + 9
        const float* m = M + (mt + g + 8 * half) * ldm + j;
        mma::split_bf16x2(f0 * m[0], f1 * m[1], ah[half], al[half]);
        mma::split_bf16x2(f8 * m[8], f9 * m[9], ah[2 + half], al[2 + half]);
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (ct + 4 * q >= tiles) break;
        uint32_t bh[4], bl[4];
        mma::load_b_trans_x4(bh, X, ldx, j0, 16 * (ct + 4 * q), lane);
        mma::load_b_trans_x4(bl, X + lo_off, ldx, j0, 16 * (ct + 4 * q), lane);
        mma::mma_3xbf16(acc[2 * q], ah, al, bh[0], bh[1], bl[0], bl[1]);
        mma::mma_3xbf16(acc[2 * q + 1], ah, al, bh[2], bh[3], bl[2], bl[3]);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = mt + g + 8 * half;
      if (i >= L) continue;
      const auto at = row(i);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = 16 * (ct + 4 * (q / 2)) + 8 * (q % 2) + 2 * t;
        if (col < n) put(at, col, acc[q][2 * half], acc[q][2 * half + 1]);  // n and col are even
      }
    }
  }
}

/// T = (I + A)^-1 for A [64][ldm] strictly lower triangular (shared memory), blocked in 16 x 16 tiles:
/// each diagonal tile T_dd = (I + A_dd)^-1 by forward substitution, a lane per column with the column
/// in registers (no barrier), then the tiles below the diagonal by distance from it,
/// T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj (2 barriers per distance), 64 threads per tile, each a row
/// x 4 columns (a float4 of T or Y per scalar of A: a quarter of the shared-memory loads of a thread
/// per element). Writes T's tiles on and below the diagonal (T [64][ldt], ldt % 4 == 0, 16-byte
/// aligned; the tiles above are not written and lower_times_rows does not read them); Y: kInvScratch
/// floats, 16-byte aligned. The same T as row-by-row substitution, up to rounding
/// (flash-linear-attention's solve_tril blocks the same way).
constexpr int kInvLd = 20;  // row stride of the scratch tiles (16-byte rows)
constexpr int kInvScratch = 3 * 16 * kInvLd;

__device__ __forceinline__ void invert_unit_lower(const float* A, int ldm, float* T, int ldt, float* Y) {
  static_assert(kThreads >= 3 * 64, "a thread per row and 4 columns of 3 tiles");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (warp < 4 && lane < 16) {  // diagonal tile `warp`, column `lane`
    const int o = 16 * warp, c = lane;
    float col[16];  // T_dd[m][c]
#pragma unroll
    for (int m = 0; m < 16; ++m) col[m] = m == c ? 1.f : 0.f;
#pragma unroll
    for (int r = 1; r < 16; ++r) {
      const float* ar = A + (o + r) * ldm + o;
      float acc = 0.f;
#pragma unroll
      for (int m = 0; m < r; ++m) acc = fmaf(ar[m], col[m], acc);
      if (r > c) col[r] = -acc;
    }
#pragma unroll
    for (int m = 0; m < 16; ++m) T[(o + m) * ldt + o + c] = col[m];
  }
  __syncthreads();
  const int p = tid / 64, r = (tid / 4) % 16, c = 4 * (tid % 4);  // tile p of the distance, row r, columns c ..
  float4* y = reinterpret_cast<float4*>(Y + (p * 16 + r) * kInvLd + c);
  for (int dist = 1; dist < 4; ++dist) {
    const int i = dist + p, j = i - dist;  // tiles (i, j), i = dist .. 3
    const bool active = i < 4;
    if (active) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int k = j; k < i; ++k) {
        const float* ar = A + (16 * i + r) * ldm + 16 * k;
        const float* tc = T + 16 * k * ldt + 16 * j + c;
#pragma unroll 8
        for (int m = 0; m < 16; ++m) {
          const float a = ar[m];
          const float4 x = *reinterpret_cast<const float4*>(tc + m * ldt);
          acc.x = fmaf(a, x.x, acc.x), acc.y = fmaf(a, x.y, acc.y), acc.z = fmaf(a, x.z, acc.z), acc.w = fmaf(a, x.w, acc.w);
        }
      }
      *y = acc;  // sum_k A_ik T_kj
    }
    __syncthreads();
    if (active) {
      const float* tr = T + (16 * i + r) * ldt + 16 * i;
      const float* yp = Y + p * 16 * kInvLd + c;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int m = 0; m < 16; ++m) {  // T_ii is lower triangular
        const float a = tr[m];
        const float4 x = *reinterpret_cast<const float4*>(yp + m * kInvLd);
        acc.x = fmaf(a, x.x, acc.x), acc.y = fmaf(a, x.y, acc.y), acc.z = fmaf(a, x.z, acc.z), acc.w = fmaf(a, x.w, acc.w);
      }
      *reinterpret_cast<float4*>(T + (16 * i + r) * ldt + 16 * j + c) = make_float4(-acc.x, -acc.y, -acc.z, -acc.w);
    }
    __syncthreads();
  }
}

/// chunk_prepare's conv inputs, queued by cp.async (complete at the next cp.async wait): the n
/// channels from c0 of the projections pj.x (n % 4 == 0, <= 128) for the chunk's rows -(K - 1) .. 63
/// from `start` into raw [64 + K - 1][n] bf16 (row 0: chunk row -(K - 1)), zeros for rows >= L and,
/// without `history`, for rows before the chunk (its sequence's first); and the channels' conv weights
/// pj.conv_w [C][K] into wsm [K][n] fp32, tap-major (a lane's 4 channels of a tap are 16 bytes next
/// to its neighbours': conflict-free). A warp per row and a lane per 4 channels, as conv_rows reads
/// them. The loops are not unrolled: unrolled, their addresses were kept in registers across
/// chunk_prepare's head loop, and spilled.
template <int K>
__device__ __forceinline__ void stage_conv_async(bf16* raw, float* wsm, const GdnProjections& pj, int c0, int n,
                                                 int start, int L, bool history) {
  const float* w = pj.conv_w + int64_t(c0) * K;
#pragma unroll 1
  for (int e = threadIdx.x; e < n * K; e += kThreads) mma::cp_async4(wsm + (e % K) * n + e / K, w + e, true);
  const int c = 4 * (threadIdx.x % 32), warp = int(threadIdx.x / 32);
  if (c >= n) return;
  constexpr int kStep = kThreads / 32;
  int64_t at = int64_t(start - (K - 1) + warp) * pj.x_stride + c0 + c;  // element of row rr = i - (K - 1)
#pragma unroll 1
  for (int i = warp; i < kChunk + K - 1; i += kStep, at += kStep * pj.x_stride) {
    const int rr = i - (K - 1);
    const bool ok = rr < L && (rr >= 0 || history);
    mma::cp_async8(raw + i * n + c, ok ? pj.x + at : pj.x, ok);
  }
}

/// Rows [0, 64) of the conv1d + SiLU output of stage_conv_async's n channels (raw, wsm in shared
/// memory, landed) into dst [64][ld] fp32, rows >= L and columns n .. width - 1 zero. kNorm: each row
/// l2-normalized and times `scale` (n a power of two <= 128, its lanes summed by xor shuffles). The
/// operations and their order are conv1d_silu_kernel's (with its fused norm): the same values. Warp w
/// takes rows 8 w .. 8 w + 7, a lane 4 channels; the inputs and weights of each row read from shared
/// memory (few registers: chunk_prepare's head loop runs at its register limit).
template <int K, bool kNorm>
__device__ __forceinline__ void conv_rows(float* dst, int ld, int width, const bf16* raw, const float* wsm, int n,
                                          int L, float scale) {
  static_assert(kThreads / 32 * 8 == kChunk, "eight rows per warp");
  const int c = 4 * (threadIdx.x % 32), r0 = 8 * (threadIdx.x / 32);
  const bool live = c < n;  // (every lane takes part in the shuffles; dead lanes compute zeros)
  const int cl = live ? c : 0;
#pragma unroll 4
  for (int r = r0; r < r0 + 8; ++r) {
    float acc[4] = {};
#pragma unroll
    for (int j = 0; j < K; ++j) {  // input row r - K + 1 + j (raw row r + j), tap j
      float x[4];
      load4(raw + (r + j) * n + cl, x);
      const float4 wt = *reinterpret_cast<const float4*>(wsm + j * n + cl);
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[v] += (&wt.x)[v] * x[v];
    }
    float out[4];
#pragma unroll
    for (int v = 0; v < 4; ++v) out[v] = r < L && live ? fast_silu(acc[v]) : 0.f;
    if constexpr (kNorm) l2norm_lanes(out, n / 4, scale);
    if (c < width) *reinterpret_cast<float4*>(dst + r * ld + c) = make_float4(out[0], out[1], out[2], out[3]);
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

/// Shared memory (bytes) of chunk_prepare_kernel for r = Hv / Hk value heads per key head and conv
/// kernel size conv_k (0: no conv inside): about 104 KB at d 128, plus 768 bytes per value head (the
/// gates of all r heads), plus 4 KB of conv weights with conv_k 4; two blocks per SM on H100 / H200 up
/// to r = 12, or r = 7 with the conv.
constexpr size_t prepare_smem(int dk, int dv, int r, int conv_k) {
  return size_t(2 * kChunk * prepare_ld(dk, dv) + 2 * kChunk * (kChunk + 4) + 3 * r * kChunk + kInvScratch +
                2 * conv_k * 128) *
         sizeof(float);
}

/// One block per (chunk, key head), for each of its r = Hv / Hk value heads (GVA): A, T = (I + A)^-1,
/// w, u (fp32 [T, Hv, dv]; w as below), P (split, [chunks, Hv, 64, 64]), the in-chunk cumulative gates G (fp32
/// [T, Hv]) and the queries split (q_s [T, Hk, dkp], for chunk_out). w goes to w_out (fp32
/// [T, Hv, dk]) for the SIMT chunk_state; without w_out (null), for the tensor-core chunk_state, w
/// and the keys go split to w_s [T, Hv, dkp] and k_s [T, Hk, dkp]. Columns dk .. dkp - 1 of q_s and k_s
/// are written as zeros, w_s's are the caller's (zeros). The keys, queries and the Gram matrices K K^T and Q K^T are
/// shared by the value heads of a key head: loaded and computed once, kept in registers; the gates of
/// all r heads are summed while the Gram products run, by a warp those leave idle. kConvK > 0 (the
/// conv kernel size): the keys, queries, values and gates come from the projections pj (conv_rows,
/// gates: GdnProjections) and q, k, v, g, beta are not read. 1-D grid of chunks x Hk blocks,
/// chunk-major (chunk = block / Hk); with `prepared` (null: none) each block publishes when its chunk
/// is in memory, for a chunk_state launched beside it (publish_prepared).
template <int kConvK>
__global__ void __launch_bounds__(kThreads, 2) chunk_prepare_kernel(const float* q, const float* k, const float* v,
                                                                    const float* g, const float* beta,
                                                                    const Chunk* chunks, int Hk, int Hv, int dk, int dv,
                                                                    int dkp, float* w_out, Split w_s, Split k_s,
                                                                    Split q_s, float* u_out, Split P_s, float* G_out,
                                                                    int64_t v_stride, GdnProjections pj, int* prepared) {
  if (prepared) launch_dependents();
  extern __shared__ float4 sm4[];
  float* sm = reinterpret_cast<float*>(sm4);
  const int ld = prepare_ld(dk, dv);  // row stride (floats)
  constexpr int ldm = kChunk + 4;     // row stride of M and T (16-byte rows)
  const int chunk = int(blockIdx.x / unsigned(Hk)), kh = int(blockIdx.x % unsigned(Hk));
  const Chunk ch = chunks[chunk];
  const int r = Hv / Hk, L = ch.len, tid = threadIdx.x;
  float* Ks = sm;                        // [64][ld] keys, later split in place
  float* Xs = Ks + kChunk * ld;          // [64][ld] queries, later values (split in place)
  float* M = Xs + kChunk * ld;           // [64][ldm] A
  float* Tm = M + kChunk * ldm;          // [64][ldm] T = (I + A)^-1
  float* G = Tm + kChunk * ldm;          // [r][64] cumulative gates
  float* Bt = G + r * kChunk;            // [r][64] beta
  float* Bg = Bt + r * kChunk;           // [r][64] beta * exp(G)
  float* Y = Bg + r * kChunk;            // [3][16][kInvLd] scratch of the inverse
  float* Wc = Y + kInvScratch;           // kConvK > 0: [2][kConvK][<= 128] conv weights (keys | queries, or values)
  const int dv16 = state_rows(dv);  // <= ld: the columns the products read (keys: dkp)
  // kConvK > 0: conv1d + SiLU (+ l2norm) of the projections here, a chunk that is not its
  // sequence's first continuing the previous rows. Their inputs are copied (cp.async, landing while
  // the gates are computed) into M's and T's space, free until the first head's A and inverse.
  const bool history = chunk > 0 && chunks[chunk - 1].seq == ch.seq;
  const int qk_ch = Hk * dk;
  static_assert((kChunk + kConvK - 1) * 128 * sizeof(bf16) <= kChunk * ldm * sizeof(float),
                "the conv inputs of 128 channels fit A's and T's tiles");
  bf16* const raw_k = reinterpret_cast<bf16*>(M);  // [64 + kConvK - 1][dk] bf16: fits M's [64][68] fp32
  bf16* const raw_x = reinterpret_cast<bf16*>(Tm);
  if constexpr (kConvK > 0) {
    stage_conv_async<kConvK>(raw_k, Wc, pj, qk_ch + kh * dk, dk, ch.start, L, history);
    stage_conv_async<kConvK>(raw_x, Wc + kConvK * dk, pj, kh * dk, dk, ch.start, L, history);
  } else {
    load_rows_async(Ks, ld, dkp, k, ch.start, L, Hk, kh, dk, 0, dk);
    load_rows_async(Xs, ld, dkp, q, ch.start, L, Hk, kh, dk, 0, dk);
  }
  mma::cp_async_commit();
  for (int e = tid; e < r * kChunk; e += kThreads) {  // the gates of the r value heads
    const int hh = e / kChunk, i = e % kChunk, h = kh * r + hh;
    const int64_t t = ch.start + i;
    if (i >= L) {
      G[e] = Bt[e] = 0.f;
    } else if constexpr (kConvK > 0) {
      gates(pj.b[t * pj.ba_stride + h], pj.a[t * pj.ba_stride + h], pj.A_log[h], pj.dt_bias[h], G[e], Bt[e]);
    } else {
      G[e] = g[t * Hv + h];
      Bt[e] = beta[t * Hv + h];
    }
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  if constexpr (kConvK > 0) {
    conv_rows<kConvK, true>(Ks, ld, dkp, raw_k, Wc, dk, L, 1.f);
    conv_rows<kConvK, true>(Xs, ld, dkp, raw_x, Wc + kConvK * dk, dk, L, pj.q_scale);
    __syncthreads();
  }
  // Keys and queries split in place (each fp32 row becomes its bf16 high and low parts), then stored
  // (q_s, k_s; 16 bytes per lane) and multiplied from there.
  const bf16* Kb = reinterpret_cast<const bf16*>(Ks);
  const bf16* Qb = reinterpret_cast<const bf16*>(Xs);
  const int lds = 2 * ld, lo = ld + 4;  // the split rows: row stride (bf16), low part offset
  {
    float* const kq[2] = {Ks, Xs};
    split_rows_in_place(kq, ld, dkp);
  }
  const int64_t qk0 = (int64_t(ch.start) * Hk + kh) * dkp;  // the chunk's first row of q_s and k_s
  store_split_rows(q_s, int64_t(Hk) * dkp, qk0, Qb, lds, lo, L, dkp);
  if (!w_out) store_split_rows(k_s, int64_t(Hk) * dkp, qk0, Kb, lds, lo, L, dkp);
  // K K^T and Q K^T on tensor cores (3xBF16): warp w takes rows 16 (w / 2) .. + 15 and columns
  // 32 (w % 2) .. + 31; B = K^T reads key rows, shared by both products. Only the lower triangles are
  // used: warps 1 and 3, above the diagonal, keep zeros, and warp 1 sums the gates meanwhile.
  const int lane = tid % 32, warp = tid / 32, gq = lane / 4, tq = lane % 4;
  const int mt = 16 * (warp / 2), nc = 32 * (warp % 2);
  const bool lower = nc < mt + 16;
  float kk[4][4] = {}, qk[4][4] = {};
  for (int c0 = 0; c0 < dkp && lower; c0 += 16) {
    uint32_t kh_[4], kl[4], qh[4], ql[4];
    mma::load_a_x4(kh_, Kb, lds, mt, c0, lane);
    mma::load_a_x4(kl, Kb + lo, lds, mt, c0, lane);
    mma::load_a_x4(qh, Qb, lds, mt, c0, lane);
    mma::load_a_x4(ql, Qb + lo, lds, mt, c0, lane);
#pragma unroll
    for (int np = 0; np < 2; ++np) {  // B[c][j] = k_j[c]: key rows nc + 16 np .. as two n-tiles
      uint32_t bh[4], bl[4];
      mma::load_b_x4(bh, Kb, lds, nc + 16 * np, c0, lane);
      mma::load_b_x4(bl, Kb + lo, lds, nc + 16 * np, c0, lane);
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // n-tile 2 np + e: rows nc + 16 np + 8 e (b[2 e], b[2 e + 1])
        mma::mma_3xbf16(kk[2 * np + e], kh_, kl, bh[2 * e], bh[2 * e + 1], bl[2 * e], bl[2 * e + 1]);
        mma::mma_3xbf16(qk[2 * np + e], qh, ql, bh[2 * e], bh[2 * e + 1], bl[2 * e], bl[2 * e + 1]);
      }
    }
  }
  if (warp == 1) {
    for (int hh = lane; hh < r; hh += 32) {  // in order (the reference's rounding); a register carries the sum
      float* Gh = G + hh * kChunk;
      float acc = Gh[0];
#pragma unroll 16
      for (int i = 1; i < kChunk; ++i) Gh[i] = acc += Gh[i];
    }
    __syncwarp();
    for (int e = lane; e < r * kChunk; e += 32) Bg[e] = Bt[e] * __expf(G[e]);
  }
  __syncthreads();  // the gates are summed; the Gram products are done with the queries
  const bf16* Vb = reinterpret_cast<const bf16*>(Xs);
  const auto put_f32 = [](float* at, int c, float x0, float x1) { *reinterpret_cast<float2*>(at + c) = make_float2(x0, x1); };
  for (int hh = 0; hh < r; ++hh) {
    const int h = kh * r + hh;
    const float *Gh = G + hh * kChunk, *Bth = Bt + hh * kChunk, *Bgh = Bg + hh * kChunk;
    if (hh) __syncthreads();  // the previous head is done with M, T and Xs
    // kConvK > 0: the values' conv inputs copied into T's space while A and P are computed.
    if constexpr (kConvK > 0) {
      stage_conv_async<kConvK>(raw_x, Wc, pj, 2 * qk_ch + h * dv, dv, ch.start, L, history);
      mma::cp_async_commit();
    }
    // A (strictly lower; the diagonal tiles' upper parts zero) and P (lower; the upper tiles zero).
    // Each decay is one exp2 of its own difference of gates (products of per-row and per-column
    // factors would overflow), computed for every element and masked after.
    const int64_t P0 = (int64_t(chunk) * Hv + h) * kChunk * kChunk + (mt + gq) * kChunk + nc + 2 * tq;
    const Split Pw = {P_s.hi + P0, P_s.lo + P0};  // the lane's first pair
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = mt + gq + 8 * half;
      const float gi = Gh[i], bi = Bth[i];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int j = nc + 8 * nt + 2 * tq;
        float p[2] = {0.f, 0.f};
        if (lower) {
          float a[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = fast_exp2((gi - Gh[j + e]) * kLog2e);
            const float decay = j + e <= i && i < L ? x : 0.f;
            a[e] = j + e < i ? bi * decay * kk[nt][2 * half + e] : 0.f;
            p[e] = decay * qk[nt][2 * half + e];
          }
          *reinterpret_cast<float2*>(M + i * ldm + j) = make_float2(a[0], a[1]);
        }
        store_split(Pw, 8 * half * kChunk + 8 * nt, p[0], p[1]);
      }
    }
    // The values (the queries were last read before the barrier after the Gram products): their
    // conv from the landed inputs, or their copy, which lands while T and w are computed.
    if constexpr (kConvK > 0) {
      mma::cp_async_wait<0>();
      __syncthreads();
      conv_rows<kConvK, false>(Xs, ld, dv16, raw_x, Wc, dv, L, 1.f);
    } else {
      load_rows_async(Xs, ld, dv16, v, ch.start, L, Hv, h, dv, 0, dv, kChunk, v_stride);
      mma::cp_async_commit();
    }
    __syncthreads();  // (kConvK > 0: the conv is done with T's space)
    invert_unit_lower(M, ldm, Tm, ldm, Y);  // T = (I + A)^-1 (synchronizes)
    if (w_out)  // w = T diag(beta e^G) K
      lower_times_rows(
          Tm, ldm, Bgh, Kb, lds, lo, L, dk, [&](int i) { return w_out + (int64_t(ch.start + i) * Hv + h) * dk; }, put_f32);
    else
      lower_times_rows(
          Tm, ldm, Bgh, Kb, lds, lo, L, dk,
          [&](int i) {
            const int64_t at = (int64_t(ch.start + i) * Hv + h) * dkp;
            return Split{w_s.hi + at, w_s.lo + at};
          },
          [](Split at, int c, float x0, float x1) { store_split(at, c, x0, x1); });
    mma::cp_async_wait<0>();
    __syncthreads();  // every thread's values have landed
    split_rows_in_place<1>({Xs}, ld, dv16);
    lower_times_rows(  // u = T diag(beta) V
        Tm, ldm, Bth, Vb, lds, lo, L, dv, [&](int i) { return u_out + (int64_t(ch.start + i) * Hv + h) * dv; }, put_f32);
    if (tid < L) G_out[int64_t(ch.start + tid) * Hv + h] = Gh[tid];
  }
  publish_prepared(prepared);
}

/// The chunk_state of GPUs with less shared memory than the tensor-core kernel below needs (A100:
/// 163 KB per block; about 103 KB here at dk 128), fp32 SIMT. One block per (sequence, value head,
/// 32 state columns): walks the sequence's chunks in order and
/// keeps only what is sequential: saves the state before each chunk (H_s, split, [chunks, Hv, dkp,
/// dv8]), the chunk's U = u - w S0 (U_s, split, [T, Hv, dv8]), then S = exp(G_L) S0 +
/// (diag(exp(G_L - G)) K)^T U. Loads run ahead of the math (cp.async): the chunk's keys while U is computed, the next chunk's w,
/// u and gates while the state is updated. Thread tiles: U rows ur + 32 r (r < 2) x columns
/// 4 cp .. 4 cp + 3; S rows 4 ur .. 4 ur + 3 x the same columns. progress as chunk_state_kernel's.
constexpr int kSimtCols = 32;

__global__ void __launch_bounds__(kThreads, 2) chunk_state_simt_kernel(const float* k, const float* w_in, const float* u_in,
                                                               const float* G_in, const Chunk* chunks,
                                                               const int32_t* first_chunk, int Hk, int Hv, int dk,
                                                               int dv, const float* init, float* final_state,
                                                               Split H_s, Split U_s, int* progress) {
  launch_dependents();
  extern __shared__ float4 sm4[];
  float* sm = reinterpret_cast<float*>(sm4);
  constexpr int ldu = kSimtCols + 4;
  const int dkp = state_rows(dk), dv8 = value_cols(dv);
  const int ld = dk + 4;
  float* S = sm;                          // [dk][kSimtCols] state columns c0 .. c0 + kSimtCols - 1
  float* Xw = S + dk * kSimtCols;             // [64][ld] w rows of the current chunk
  float* Xk = Xw + kChunk * ld;           // [64][ld] k rows of the current chunk
  float* Ub = Xk + kChunk * ld;           // 2 x [64][ldu] u, then U (buffer ci & 1)
  float* Gb = Ub + 2 * kChunk * ldu;      // 2 x [64] in-chunk cumulative gates (buffer ci & 1)
  float* D = Gb + 2 * kChunk;             // [64] exp(G_L - G_j)
  const int seq = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * kSimtCols, kh = h / (Hv / Hk), tid = threadIdx.x;
  const int cp = tid % (kSimtCols / 4), c = 4 * cp, ur = tid / (kSimtCols / 4);  // ur < 32
  const int ncols = min(kSimtCols, dv - c0);
  const int64_t state_off = (int64_t(seq) * Hv + h) * dk * dv;
  for (int e = tid; e < dk * kSimtCols; e += kThreads) {
    const int m = e / kSimtCols, cc = e % kSimtCols;
    S[e] = init && cc < ncols ? init[state_off + int64_t(m) * dv + c0 + cc] : 0.f;
  }
  const int c_first = first_chunk[seq], c_end = first_chunk[seq + 1];
  // w, u and the gates of chunk ci into Xw, Ub[ci & 1], Gb[ci & 1] (one cp.async group).
  auto fetch_next = [&](int ci) {
    if (ci < c_end) {
      const Chunk ch = chunks[ci];
      float* Gd = Gb + (ci & 1) * kChunk;
      load_rows_async(Xw, ld, dk, w_in, ch.start, ch.len, Hv, h, dk, 0, dk);
      load_rows_async(Ub + (ci & 1) * kChunk * ldu, ldu, kSimtCols, u_in, ch.start, ch.len, Hv, h, dv, c0, ncols);
      if (tid < kChunk) mma::cp_async4(Gd + tid, G_in + int64_t(ch.start + min(tid, ch.len - 1)) * Hv + h, tid < ch.len);
    }
    mma::cp_async_commit();
  };
  fetch_next(c_first);
  mma::cp_async_wait<0>();
  __syncthreads();
  for (int ci = c_first; ci < c_end; ++ci) {
    const Chunk ch = chunks[ci];
    const int L = ch.len;
    float* U = Ub + (ci & 1) * kChunk * ldu;
    const float* G = Gb + (ci & 1) * kChunk;
    load_rows_async(Xk, ld, dk, k, ch.start, L, Hk, kh, dk, 0, dk);  // keys, for the state update below
    mma::cp_async_commit();
    const int64_t H0 = (int64_t(ci) * Hv + h) * dkp * dv8 + c0;  // the state before this chunk
    for (int e = tid; e < dk * kSimtCols / 2; e += kThreads) {
      const int m = e / (kSimtCols / 2), cc = 2 * (e % (kSimtCols / 2));
      if (cc < ncols) store_split(H_s, H0 + int64_t(m) * dv8 + cc, S[m * kSimtCols + cc], S[m * kSimtCols + cc + 1]);
    }
    if (tid < kChunk) D[tid] = tid < L ? __expf(G[L - 1] - G[tid]) : 0.f;
    // U = u_hat - w S0
    float acc[2][4] = {};
    for (int m = 0; m < dk; m += 4) {
      float4 sv[4];
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) sv[mm] = *reinterpret_cast<const float4*>(S + (m + mm) * kSimtCols + c);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float4 x = *reinterpret_cast<const float4*>(Xw + (ur + 32 * r) * ld + m);
        acc[r][0] += x.x * sv[0].x + x.y * sv[1].x + x.z * sv[2].x + x.w * sv[3].x;
        acc[r][1] += x.x * sv[0].y + x.y * sv[1].y + x.z * sv[2].y + x.w * sv[3].y;
        acc[r][2] += x.x * sv[0].z + x.y * sv[1].z + x.z * sv[2].z + x.w * sv[3].z;
        acc[r][3] += x.x * sv[0].w + x.y * sv[1].w + x.z * sv[2].w + x.w * sv[3].w;
      }
    }
    __syncthreads();  // Xw (w) and D are done with: the next chunk's w, u and gates load behind the update
    fetch_next(ci + 1);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = ur + 32 * r;
      if (i >= L) continue;
      float* ui = U + i * ldu + c;
#pragma unroll
      for (int q = 0; q < 4; ++q) ui[q] -= acc[r][q];
      const int64_t at = (int64_t(ch.start + i) * Hv + h) * dv8 + c0 + c;  // ncols and c are even
      if (c < ncols) store_split(U_s, at, ui[0], ui[1]);
      if (c + 2 < ncols) store_split(U_s, at + 2, ui[2], ui[3]);
    }
    mma::cp_async_wait<1>();  // the keys (not the next chunk's loads)
    __syncthreads();
    // S = exp(G_L) S0 + (diag(exp(G_L - G)) K)^T U
    const int m0 = 4 * ur;
    if (m0 < dk) {
      const float gl = __expf(G[L - 1]);
      float sa[4][4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int q = 0; q < 4; ++q) sa[r][q] = gl * S[(m0 + r) * kSimtCols + c + q];
      for (int j = 0; j < L; ++j) {
        const float4 kx = *reinterpret_cast<const float4*>(Xk + j * ld + m0);
        const float f = D[j];
        const float x[4] = {kx.x * f, kx.y * f, kx.z * f, kx.w * f};
        const float4 uv = *reinterpret_cast<const float4*>(U + j * ldu + c);
#pragma unroll
        for (int r = 0; r < 4; ++r) sa[r][0] += x[r] * uv.x, sa[r][1] += x[r] * uv.y, sa[r][2] += x[r] * uv.z, sa[r][3] += x[r] * uv.w;
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int q = 0; q < 4; ++q) S[(m0 + r) * kSimtCols + c + q] = sa[r][q];
    }
    mma::cp_async_wait<0>();  // the next chunk's w, u and gates
    __syncthreads();
    publish_progress(progress, ci, c_first, c_end);
  }
  if (final_state)
    for (int e = tid; e < dk * kSimtCols; e += kThreads) {
      const int m = e / kSimtCols, cc = e % kSimtCols;
      if (cc < ncols) final_state[state_off + int64_t(m) * dv + c0 + cc] = S[e];
    }
}


/// Shared memory of chunk_state_kernel<cols> at key dim dk, in bytes: the gates (2 x 64) and D (64)
/// in fp32, then in bf16 the split S0 (2 x [dkp][cols + 8]), w and k (2 buffers x 2 parts x
/// [64][dkp + 8] each), U and diag(D) U (2 x [64][cols + 8] each). Row strides 16 bytes past a
/// multiple of 32: every ldmatrix and fragment store is free of bank conflicts.
constexpr size_t chunk_state_smem(int dk, int cols) {
  const int dkp = state_rows(dk);
  return size_t(2 * dkp * (cols + 8) + 8 * kChunk * (dkp + 8) + 4 * kChunk * (cols + 8)) * sizeof(bf16) +
         3 * kChunk * sizeof(float);
}

/// One block per (sequence, value head, kCols = 32 or 64 state columns): walks the sequence's chunks in
/// order and keeps only what is sequential: saves the state before each chunk (H_s, split, [chunks, Hv,
/// dkp, dv8]), the chunk's U = u - w S0 (U_s, split, [T, Hv, dv8]), then S = exp(G_L) S0 +
/// K^T diag(exp(G_L - G)) U. Grid (sequences, Hv, column blocks); progress (null: none)
/// [sequences, Hv, column blocks]: each block's chunks done, published every kPublish chunks.
/// Both products on tensor cores in 3xBF16 (mma_3xbf16, ~2^-16 relative per product) from operands
/// split once: w and k by chunk_prepare (bf16 pairs [T, H, dkp]), S0 and diag(D) U here as they are
/// made. The state itself stays fp32 in registers for the whole sequence: warp w owns state rows
/// 16 w .. + 15 x all kCols columns (C fragments), and U rows 16 (w / 2) .. + 15 x columns kCols / 2
/// (w % 2) ... Every input of chunk ci + 1 (w, k, gates by cp.async, u into registers) loads while
/// chunk ci is computed: the chain of chunks waits on no memory, except, with `prepared` (launched
/// beside chunk_prepare, prep_blocks of its blocks), for chunk ci + 1 to be published (wait_prepared)
/// before its loads are issued.
template <int kCols>
__global__ void __launch_bounds__(kThreads, 1) chunk_state_kernel(Split k_s, Split w_s, const float* u_in,
                                                               const float* G_in, const Chunk* chunks,
                                                               const int32_t* first_chunk, int Hk, int Hv, int dk,
                                                               int dv, const float* init, float* final_state,
                                                               Split H_s, Split U_s, int* progress,
                                                               const int* prepared, int prep_blocks) {
  launch_dependents();
  extern __shared__ float4 sm4[];
  constexpr int ldc = kCols + 8;          // bf16 row stride of S0 and diag(D) U
  const int dkp = state_rows(dk), ldw = dkp + 8, dv8 = value_cols(dv);
  float* Gb = reinterpret_cast<float*>(sm4);       // 2 x [64] in-chunk cumulative gates (buffer ci & 1)
  float* D = Gb + 2 * kChunk;                      // [64] exp(G_L - G_j)
  bf16* Sh = reinterpret_cast<bf16*>(D + kChunk);  // [dkp][ldc] S0, high part
  bf16* Sl = Sh + dkp * ldc;                       //             low part
  bf16* Wb = Sl + dkp * ldc;                       // 2 buffers x {hi, lo} x [64][ldw] w rows
  bf16* Kb = Wb + 4 * kChunk * ldw;                // the same for k
  bf16* Uh = Kb + 4 * kChunk * ldw;                // [64][ldc] diag(D) U, high part
  bf16* Ul = Uh + kChunk * ldc;                    //                      low part
  bf16* Ur = Ul + kChunk * ldc;                    // {hi, lo} x [64][ldc] U (for chunk_out)
  const int seq = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * kCols, kh = h / (Hv / Hk), tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int ncols = min(kCols, dv - c0), ncols8 = min(kCols, dv8 - c0);  // ncols8: the split outputs' columns
  const int64_t state_off = (int64_t(seq) * Hv + h) * dk * dv;
  constexpr int kUn = kCols / 16, kSn = kCols / 8;                // n-tiles per warp: U, state
  const int um = 16 * (warp / 2), un = (kCols / 2) * (warp % 2);  // this warp's U tile
  const int sm0 = 16 * warp;                                      // this warp's state rows
  const bool owns = sm0 < dkp;
  float S[kSn][4];  // rows sm0 + g (+ 8 for [2], [3]) x columns 8 nt + 2 t (+ 1)
#pragma unroll
  for (int nt = 0; nt < kSn; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = sm0 + g + 8 * (e / 2), col = 8 * nt + 2 * t + e % 2;
      S[nt][e] = init && owns && row < dk && col < ncols ? init[state_off + int64_t(row) * dv + c0 + col] : 0.f;
    }
  const int c_first = first_chunk[seq], c_end = first_chunk[seq + 1];
  // w, k and the gates of chunk ci into buffer ci & 1 (one cp.async group; rows past the chunk zero).
  auto fetch = [&](int ci, const Chunk& ch) {
    if (ci < c_end) {
      load_split_async(Wb + (ci & 1) * 2 * kChunk * ldw, ldw, kChunk * ldw, w_s, int64_t(Hv) * dkp,
                       (int64_t(ch.start) * Hv + h) * dkp, ch.len, dkp, dkp, kChunk);
      load_split_async(Kb + (ci & 1) * 2 * kChunk * ldw, ldw, kChunk * ldw, k_s, int64_t(Hk) * dkp,
                       (int64_t(ch.start) * Hk + kh) * dkp, ch.len, dkp, dkp, kChunk);
      if (tid < kChunk)
        mma::cp_async4(Gb + (ci & 1) * kChunk + tid, G_in + int64_t(ch.start + min(tid, ch.len - 1)) * Hv + h,
                       tid < ch.len);
    }
    mma::cp_async_commit();
  };
  // This warp's u tile of chunk ci into registers (C fragments; zero past the chunk and ncols).
  auto load_u = [&](float (&u)[kUn][4], const Chunk& ch) {
#pragma unroll
    for (int nn = 0; nn < kUn; ++nn)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = um + g + 8 * half, col = un + 8 * nn + 2 * t;
        float2 x = make_float2(0.f, 0.f);
        if (row < ch.len && col < ncols)  // ncols and col are even
          x = *reinterpret_cast<const float2*>(u_in + (int64_t(ch.start + row) * Hv + h) * dv + c0 + col);
        u[nn][2 * half] = x.x, u[nn][2 * half + 1] = x.y;
      }
  };
  float uc[kUn][4], un_next[kUn][4];
  bool all_prepared = false;
  if (c_first < c_end) wait_prepared(prepared, prep_blocks, c_first, Hk, kh, all_prepared);
  // The chunk table rides two chunks ahead in registers: no load of it waits in the chain.
  auto chunk_at = [&](int ci) { return ci < c_end ? chunks[ci] : Chunk{0, 0, 0}; };
  Chunk cur = chunk_at(c_first), nxt = chunk_at(c_first + 1);
  load_u(uc, cur);
  fetch(c_first, cur);
  mma::cp_async_wait<0>();
  __syncthreads();
  for (int ci = c_first; ci < c_end; ++ci) {
    const int L = cur.len, start = cur.start, b = ci & 1;
    const Chunk after = chunk_at(ci + 2);  // used from the next chunk on
    const bf16* W = Wb + b * 2 * kChunk * ldw;
    const bf16* K = Kb + b * 2 * kChunk * ldw;
    const float* G = Gb + b * kChunk;
    if (ci + 1 < c_end) wait_prepared(prepared, prep_blocks, ci + 1, Hk, kh, all_prepared);
    fetch(ci + 1, nxt);  // into the buffers chunk ci - 1 used, read before the last barrier
    load_u(un_next, nxt);
    if (owns)  // the state before this chunk, split, to shared memory
#pragma unroll
      for (int nt = 0; nt < kSn; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = sm0 + g + 8 * half, col = 8 * nt + 2 * t;
          mma::split_bf16x2(S[nt][2 * half], S[nt][2 * half + 1], *reinterpret_cast<uint32_t*>(Sh + row * ldc + col),
                            *reinterpret_cast<uint32_t*>(Sl + row * ldc + col));
        }
    if (tid < kChunk) D[tid] = tid < L ? __expf(G[L - 1] - G[tid]) : 0.f;
    __syncthreads();  // S0 and D complete
    store_split_rows(H_s, dv8, (int64_t(ci) * Hv + h) * dkp * dv8 + c0, Sh, ldc, dkp * ldc, dkp, ncols8);
    {  // U = u - w S0 for this warp's tile; then diag(D) U, split, for the state update
      float acc[kUn][4] = {}, lo[kUn][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < 128; k0 += 16) {  // unrolled: fragments load ahead of the products
        if (k0 >= dkp) break;
        mma::mma_step_3xbf16<kUn / 2>(acc, lo, W, ldw, kChunk * ldw, um, Sh, ldc, dkp * ldc, un, k0, lane);
      }
#pragma unroll
      for (int nn = 0; nn < kUn; ++nn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nn][e] += lo[nn][e];
#pragma unroll
      for (int nn = 0; nn < kUn; ++nn)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = um + g + 8 * half, col = un + 8 * nn + 2 * t;
          const float x0 = uc[nn][2 * half] - acc[nn][2 * half], x1 = uc[nn][2 * half + 1] - acc[nn][2 * half + 1];
          mma::split_bf16x2(x0, x1, *reinterpret_cast<uint32_t*>(Ur + row * ldc + col),
                            *reinterpret_cast<uint32_t*>(Ur + kChunk * ldc + row * ldc + col));
          const float d = D[row];  // zero past the chunk
          mma::split_bf16x2(x0 * d, x1 * d, *reinterpret_cast<uint32_t*>(Uh + row * ldc + col),
                            *reinterpret_cast<uint32_t*>(Ul + row * ldc + col));
        }
    }
    __syncthreads();  // U and diag(D) U complete; every warp is done reading S0
    store_split_rows(U_s, int64_t(Hv) * dv8, (int64_t(start) * Hv + h) * dv8 + c0, Ur, ldc, kChunk * ldc, L, ncols8);
    if (owns) {  // S = exp(G_L) S0 + K^T diag(D) U for this warp's 16 state rows
      const float gl = __expf(G[L - 1]);
      float lo[kSn][4] = {};
#pragma unroll
      for (int nt = 0; nt < kSn; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[nt][e] *= gl;
#pragma unroll
      for (int j0 = 0; j0 < kChunk; j0 += 16) {  // rows L .. are zero in K and diag(D) U
        if (j0 >= L) break;
        mma::mma_step_3xbf16<kSn / 2, true>(S, lo, K, ldw, kChunk * ldw, sm0, Uh, ldc, kChunk * ldc, 0, j0, lane);
      }
#pragma unroll
      for (int nt = 0; nt < kSn; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[nt][e] += lo[nt][e];
    }
#pragma unroll
    for (int nn = 0; nn < kUn; ++nn)
#pragma unroll
      for (int e = 0; e < 4; ++e) uc[nn][e] = un_next[nn][e];
    cur = nxt, nxt = after;
    mma::cp_async_wait<0>();  // chunk ci + 1
    __syncthreads();
    publish_progress(progress, ci, c_first, c_end);
  }
  if (final_state && owns)
#pragma unroll
    for (int nt = 0; nt < kSn; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = sm0 + g + 8 * half, col = 8 * nt + 2 * t;
        if (row < dk && col < ncols)
          *reinterpret_cast<float2*>(final_state + state_off + int64_t(row) * dv + c0 + col) =
              make_float2(S[nt][2 * half], S[nt][2 * half + 1]);
      }
}

// ---------------------------------------------------------------------------------------------
// chunk_state on Hopper (sm_90a, state rows dkp = 128, 64 state columns per block): the same chain
// with warpgroup MMAs reading every operand from shared memory in the 128-byte swizzle (wgmma.cuh),
// so no warp loads fragments and the tensor cores take whole 64-row products. Per chunk, after the
// state before it is split to shared memory: warpgroup 0 computes U = u - w S0 (m64n64, k = 128)
// while warpgroup 1 queues the next chunk's w, k and gates (cp.async; not before the first barrier:
// the proxy fence there would wait for the copies) and loads its u into registers; then both update
// the state, warpgroup w its rows 64 w .. 64 w + 63: S = exp(G_L) S0 + K^T diag(D) U (m64n64, k =
// the chunk's rows, K^T read MN-major), the state as their accumulators (the mma.sync layout of
// chunk_state_kernel: warp w rows 16 w ..), while every thread stores the state before the chunk
// and U, and warpgroup 1 puts the next u in shared memory. The same 3xBF16 products as
// chunk_state_kernel. (The split of work between the barriers follows ncu's stall samples: the
// warpgroup that waits at a barrier has work to take over; the report of commit abc5e5e (git history of bench/results).)

constexpr int kSw = 64;           // bf16 columns of a 128-byte swizzle block
constexpr int kUld = kSw + 8;     // fp32 row stride of the u tile (conflict-free float2 reads)

/// Element offset of (row r, column c) in a swizzled tile of `rows` rows stored as column blocks
/// [rows][64] (wgmma.cuh: 16-byte chunk c / 8 of row r at ((c / 8) ^ r % 8) 16 bytes).
__device__ __forceinline__ int sw128(int r, int c, int rows) {
  return (c / kSw) * rows * kSw + r * kSw + ((((c % kSw) / 8) ^ (r % 8)) * 8) + c % 8;
}

/// Rows [0, 64) x 128 columns of a split bf16 tensor (row r at src + off0 + r stride) into the
/// swizzled tiles hi / lo [64][128] by cp.async, by threads [0, 128) (index i); rows >= L
/// zero-filled. Completes at a later wait.
__device__ __forceinline__ void load_split_sw(bf16* hi, bf16* lo, Split src, int64_t stride, int64_t off0, int L, int i) {
#pragma unroll
  for (int k = 0; k < kChunk * 16 / 128; ++k) {  // 16-byte units of one part, 128 threads
    const int u = i + 128 * k, r = u / 16, c = 8 * (u % 16);
    const bool ok = r < L;
    const int64_t at = ok ? off0 + r * stride + c : 0;
    const int d = sw128(r, c, kChunk);
    mma::cp_async16(hi + d, src.hi + at, ok);
    mma::cp_async16(lo + d, src.lo + at, ok);
  }
}

/// store_split_rows from swizzled [rows][64] tiles hi / lo, by threads [0, n) (index i): whole
/// 16-byte units per thread, ncols (a multiple of 8, <= 64) columns.
__device__ __forceinline__ void store_split_sw(Split dst, int64_t stride, int64_t off0, const bf16* hi, const bf16* lo,
                                               int rows, int ncols, int i, int n) {
  for (int u = i; u < rows * 8; u += n) {
    const int r = u / 8, c = 8 * (u % 8);
    if (c >= ncols) continue;
    const int64_t at = off0 + r * stride + c;
    const int s = sw128(r, c, rows);
    *reinterpret_cast<uint4*>(dst.hi + at) = *reinterpret_cast<const uint4*>(hi + s);
    *reinterpret_cast<uint4*>(dst.lo + at) = *reinterpret_cast<const uint4*>(lo + s);
  }
}

/// The 3xBF16 product of chunk_state_wgmma_kernel on warpgroup MMAs over kSteps k steps of 16:
/// acc (+)= Ah Bh (kAccumulate: added to acc's values, else overwriting them) and lo = Ah Bl + Al Bh,
/// to be added to acc once complete. a(part, ks), b(part, ks): the descriptors of k step ks of the
/// high (part 0) or low (1) operand; kTransA / kTransB as wgmma::m64n64k16_ss. Issued, not committed.
template <int kSteps, bool kAccumulate, int kTransA, int kTransB, typename A, typename B>
__device__ __forceinline__ void wgmma_3xbf16(float (&acc)[8][4], float (&lo)[8][4], A a, B b) {
  wgmma::fence();
  wgmma::m64n64k16_ss<kAccumulate, kTransA, kTransB>(acc, a(0, 0), b(0, 0));
#pragma unroll
  for (int ks = 1; ks < kSteps; ++ks) wgmma::m64n64k16_ss<true, kTransA, kTransB>(acc, a(0, ks), b(0, ks));
  wgmma::m64n64k16_ss<false, kTransA, kTransB>(lo, a(0, 0), b(1, 0));
#pragma unroll
  for (int ks = 1; ks < kSteps; ++ks) wgmma::m64n64k16_ss<true, kTransA, kTransB>(lo, a(0, ks), b(1, ks));
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) wgmma::m64n64k16_ss<true, kTransA, kTransB>(lo, a(1, ks), b(0, ks));
}

/// Shared memory of chunk_state_wgmma_kernel, bytes: bf16 tiles (the split S0 [128][64], w and k in
/// two buffers of [64][128] each, diag(D) U and U [64][64], two parts each), then fp32 u [64][kUld],
/// the gates (2 x 64) and D (64), and up to 1024 bytes to align the tiles.
constexpr size_t chunk_state_wgmma_smem() {
  return size_t(2 * 128 * kSw + 2 * 2 * 2 * kChunk * 128 + 2 * 2 * kChunk * kSw) * sizeof(bf16) +
         size_t(kChunk * kUld + 3 * kChunk) * sizeof(float) + 1024;
}

/// chunk_state_kernel<64> for dkp = 128 on warpgroup MMAs (see above); the same arguments, grid and
/// outputs. w_s and k_s are read 128 columns wide (their padding past dk is zero).
__global__ void __launch_bounds__(kThreads, 1) chunk_state_wgmma_kernel(Split k_s, Split w_s, const float* u_in,
                                                                     const float* G_in, const Chunk* chunks,
                                                                     const int32_t* first_chunk, int Hk, int Hv,
                                                                     int dk, int dv, const float* init,
                                                                     float* final_state, Split H_s, Split U_s,
                                                                     int* progress, const int* prepared,
                                                                     int prep_blocks) {
  static_assert(kThreads == 256, "two warpgroups");
  launch_dependents();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kDkp = 128, kCols = kSw, kTile = kChunk * 128;  // kTile: one part of a w / k buffer
  // The tiles from the first 1024-byte boundary (pointer arithmetic on the array: shared-memory
  // instructions, not generic ones).
  const unsigned pad = (1024u - unsigned(__cvta_generic_to_shared(smem_raw)) % 1024u) % 1024u;
  bf16* Sh = reinterpret_cast<bf16*>(smem_raw + pad);
  bf16* Sl = Sh + kDkp * kCols;   // [128][64] S0, high and low parts
  bf16* Wb = Sl + kDkp * kCols;   // 2 buffers x {hi, lo} x [64][128] w rows
  bf16* Kb = Wb + 4 * kTile;      // the same for k
  bf16* DUh = Kb + 4 * kTile;     // [64][64] diag(D) U, high and low parts
  bf16* DUl = DUh + kChunk * kCols;
  bf16* Urh = DUl + kChunk * kCols;  // [64][64] U (for chunk_out), high and low parts
  bf16* Url = Urh + kChunk * kCols;
  float* Us = reinterpret_cast<float*>(Url + kChunk * kCols);  // [64][kUld] u
  float* Gb = Us + kChunk * kUld;                              // 2 x [64] in-chunk cumulative gates
  float* D = Gb + 2 * kChunk;                                  // [64] exp(G_L - G_j)
  const int seq = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * kCols, kh = h / (Hv / Hk), tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32, wg = warp / 4, g = lane / 4, t = lane % 4, i1 = tid - 128;
  const int ncols = min(kCols, dv - c0), dv8 = value_cols(dv), ncols8 = min(kCols, dv8 - c0);
  const int64_t state_off = (int64_t(seq) * Hv + h) * dk * dv;
  const int sm0 = 16 * warp;  // this warp's state rows (and in warpgroup 0 its U rows, 16 warp ..)
  float S[8][4];              // rows sm0 + g (+ 8 for [2], [3]) x columns 8 nt + 2 t (+ 1)
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = sm0 + g + 8 * (e / 2), col = 8 * nt + 2 * t + e % 2;
      S[nt][e] = init && row < dk && col < ncols ? init[state_off + int64_t(row) * dv + c0 + col] : 0.f;
    }
  const int c_first = first_chunk[seq], c_end = first_chunk[seq + 1];
  bool all_prepared = false;
  // Warpgroup 1 (thread i1): w, k and the gates of chunk ci into buffer ci & 1 (after waiting for
  // chunk_prepare to publish them), one cp.async group.
  auto fetch = [&](int ci, const Chunk& ch) {
    if (ci < c_end) {
      wait_prepared(prepared, prep_blocks, ci, Hk, kh, all_prepared);
      bf16* W = Wb + (ci & 1) * 2 * kTile;
      bf16* K = Kb + (ci & 1) * 2 * kTile;
      load_split_sw(W, W + kTile, w_s, int64_t(Hv) * kDkp, (int64_t(ch.start) * Hv + h) * kDkp, ch.len, i1);
      load_split_sw(K, K + kTile, k_s, int64_t(Hk) * kDkp, (int64_t(ch.start) * Hk + kh) * kDkp, ch.len, i1);
      if (i1 < kChunk)
        mma::cp_async4(Gb + (ci & 1) * kChunk + i1, G_in + int64_t(ch.start + min(i1, ch.len - 1)) * Hv + h,
                       i1 < ch.len);
    }
    mma::cp_async_commit();
  };
  // Warpgroup 1: u of chunk ch, its thread's 8 16-byte units of the [64][64] tile (rows past the
  // chunk and columns past ncols zero), into registers, then (put_u) into Us.
  constexpr int kUnitsU = kChunk * (kCols / 4) / 128;
  auto load_u = [&](float4 (&x)[kUnitsU], const Chunk& ch) {
#pragma unroll
    for (int k = 0; k < kUnitsU; ++k) {
      const int u = i1 + 128 * k, r = u / (kCols / 4), c = 4 * (u % (kCols / 4));
      x[k] = r < ch.len && c < ncols
                 ? *reinterpret_cast<const float4*>(u_in + (int64_t(ch.start + r) * Hv + h) * dv + c0 + c)
                 : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  auto put_u = [&](const float4 (&x)[kUnitsU]) {
#pragma unroll
    for (int k = 0; k < kUnitsU; ++k) {
      const int u = i1 + 128 * k;
      *reinterpret_cast<float4*>(Us + (u / (kCols / 4)) * kUld + 4 * (u % (kCols / 4))) = x[k];
    }
  };
  float4 un[kUnitsU];  // warpgroup 1: the next chunk's u
  auto chunk_at = [&](int ci) { return ci < c_end ? chunks[ci] : Chunk{0, 0, 0}; };
  Chunk cur = chunk_at(c_first), nxt = chunk_at(c_first + 1);
  if (wg == 1) {
    fetch(c_first, cur);
    load_u(un, cur);
    put_u(un);
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  for (int ci = c_first; ci < c_end; ++ci) {
    const int L = cur.len, start = cur.start, b = ci & 1;
    const Chunk after = chunk_at(ci + 2);
    const bf16* W = Wb + b * 2 * kTile;
    const bf16* K = Kb + b * 2 * kTile;
    const float* G = Gb + b * kChunk;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)  // the state before this chunk, split, to shared memory
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = sw128(sm0 + g + 8 * half, 8 * nt + 2 * t, kDkp);
        mma::split_bf16x2(S[nt][2 * half], S[nt][2 * half + 1], *reinterpret_cast<uint32_t*>(Sh + i),
                          *reinterpret_cast<uint32_t*>(Sl + i));
      }
    if (tid < kChunk) D[tid] = tid < L ? __expf(G[L - 1] - G[tid]) : 0.f;
    wgmma::fence_proxy_async();  // this thread's S0 split and its landed copies, read by wgmma
    __syncthreads();             // S0, D, this chunk's w, k and u complete
    if (wg == 1) {
      fetch(ci + 1, nxt);  // into the buffers chunk ci - 1 used, read before the last barrier
      load_u(un, nxt);
    } else {  // U = u - w S0 (acc: wh Sh; lo: wh Sl + wl Sh), then U and diag(D) U, split
      auto dw = [&](int part, int ks) {  // w [64][128], K-major
        return wgmma::desc_sw128(W + part * kTile + (ks / 4) * kChunk * kSw + (ks % 4) * 16, 16, 1024);
      };
      auto ds = [&](int part, int ks) {  // S0 [128][64], MN-major (k down its rows)
        return wgmma::desc_sw128((part ? Sl : Sh) + ks * 16 * kSw, kDkp * 128, 1024);
      };
      float acc[8][4], lo[8][4];
      wgmma_3xbf16<kDkp / 16, false, 0, 1>(acc, lo, dw, ds);
      wgmma::commit();
      float2 u[8][2];  // this thread's u and D, read while the products run
#pragma unroll
      for (int nn = 0; nn < 8; ++nn)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          u[nn][half] = *reinterpret_cast<const float2*>(Us + (sm0 + g + 8 * half) * kUld + 8 * nn + 2 * t);
      const float d[2] = {D[sm0 + g], D[sm0 + g + 8]};  // zero past the chunk
      wgmma::wait<0>();
#pragma unroll
      for (int nn = 0; nn < 8; ++nn)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = sw128(sm0 + g + 8 * half, 8 * nn + 2 * t, kChunk);
          const float x0 = u[nn][half].x - (acc[nn][2 * half] + lo[nn][2 * half]);
          const float x1 = u[nn][half].y - (acc[nn][2 * half + 1] + lo[nn][2 * half + 1]);
          mma::split_bf16x2(x0, x1, *reinterpret_cast<uint32_t*>(Urh + i), *reinterpret_cast<uint32_t*>(Url + i));
          mma::split_bf16x2(x0 * d[half], x1 * d[half], *reinterpret_cast<uint32_t*>(DUh + i),
                            *reinterpret_cast<uint32_t*>(DUl + i));
        }
      wgmma::fence_proxy_async();  // diag(D) U, read by wgmma
    }
    __syncthreads();  // U and diag(D) U complete; S0 and u read by every product and copy
    {  // S = exp(G_L) S0 + K^T diag(D) U for this warpgroup's 64 state rows (lo: Kh DUl + Kl DUh)
      auto dk_t = [&](int part, int j) {  // K^T: this warpgroup's 64 key columns, MN-major
        return wgmma::desc_sw128(K + part * kTile + wg * kChunk * kSw + j * 16 * kSw, kChunk * 128, 1024);
      };
      auto du = [&](int part, int j) {  // diag(D) U [64][64], MN-major
        return wgmma::desc_sw128((part ? DUl : DUh) + j * 16 * kSw, kChunk * 128, 1024);
      };
      const float gl = __expf(G[L - 1]);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[nt][e] *= gl;
      float lo[8][4];  // (all 64 rows: rows L .. are zero in K and diag(D) U; no branch around a wgmma)
      wgmma_3xbf16<kChunk / 16, true, 1, 1>(S, lo, dk_t, du);
      wgmma::commit();
      store_split_sw(H_s, dv8, (int64_t(ci) * Hv + h) * kDkp * dv8 + c0, Sh, Sl, kDkp, ncols8, tid, kThreads);
      store_split_sw(U_s, int64_t(Hv) * dv8, (int64_t(start) * Hv + h) * dv8 + c0, Urh, Url, L, ncols8, tid, kThreads);
      if (wg == 1) put_u(un);  // Us: read by warpgroup 0 before the last barrier
      wgmma::wait<0>();
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[nt][e] += lo[nt][e];
    }
    cur = nxt, nxt = after;
    mma::cp_async_wait<0>();  // chunk ci + 1's w, k and gates (warpgroup 1's copies)
    __syncthreads();
    publish_progress(progress, ci, c_first, c_end);
  }
  if (final_state)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = sm0 + g + 8 * half, col = 8 * nt + 2 * t;
        if (row < dk && col < ncols)
          *reinterpret_cast<float2*>(final_state + state_off + int64_t(row) * dv + c0 + col) =
              make_float2(S[nt][2 * half], S[nt][2 * half + 1]);
      }
}

/// One output of the gated RMSNorm: w x s silu(z), s = rsqrt(mean(x^2) + eps) of the row.
__device__ __forceinline__ float gated_norm(float w, float x, float s, float z) { return w * (x * s) * fast_silu(z); }

constexpr int kZld = 128 + 8;  // bf16 row stride of chunk_out's z tile (conflict-free bf16x2 reads)

/// bf16 elements of chunk_out_kernel's front region: split Q [64][dkp + 8] and S0 [dkp][72] (two
/// parts each), which the gated RMSNorm's z tile [64][kZld] and w [128] fp32 reuse once the last
/// product with S0 is done (at least that much).
__host__ __device__ constexpr int chunk_out_front(int dkp) {
  const int qs = 2 * (kChunk * (dkp + 8) + dkp * 72), zw = kChunk * kZld + 2 * 128;
  return qs > zw ? qs : zw;
}

/// Shared memory of chunk_out_kernel at key dim dk, in bytes: the front region, then split U [64][72]
/// and P [64][72] (S0 and U hold 64 value columns at a time).
constexpr size_t chunk_out_smem(int dk) {
  return size_t(chunk_out_front(state_rows(dk)) + 2 * 2 * kChunk * 72) * sizeof(bf16);
}

/// One block per (chunk, value head): O = diag(exp(G)) Q S0 + P U from the saved state S0 = H[chunk]
/// and U, all chunks in parallel, on tensor cores in 3xBF16 from the split operands (q_s [T, Hk,
/// dkp], H_s [chunks, Hv, dkp, dv8], U_s [T, Hv, dv8], P_s [chunks, Hv, 64, 64]), in passes of 64
/// value columns (dv <= 128: one or two; Q and P load once). Warp w computes rows 16 (w / 2) .. + 15
/// x columns 32 (w % 2) .. + 31 of each pass. kNorm: the rows then go through the gated RMSNorm (a
/// row's sum of squares over its quad, both passes and the warp pair) to norm.y (bf16); otherwise to
/// o (fp32 [T, Hv, dv]). Where 16-byte copies fit (z, w and y 16-byte aligned, z_stride and dv
/// multiples of 8) the norm's z and w load into shared memory (cp.async, behind the last product) and
/// y leaves from there in whole rows; else each thread reads and writes its own in memory. A 1-D
/// grid of chunks x Hv blocks, chunk-major (the order chunk_state makes them); with progress (see
/// kPublish; col_blocks chunk_state blocks per sequence and head) each block waits for its chunk's
/// state and U, and with `prepared` (chunk_state beside chunk_prepare) first for its chunk's Q and P
/// (wait_prepared).
template <bool kNorm>
__global__ void __launch_bounds__(kThreads, 2) chunk_out_kernel(Split q_s, Split H_s, Split U_s, Split P_s,
                                                             const float* G_in, const Chunk* chunks, int Hk, int Hv,
                                                             int dk, int dv, float* o, GatedNormOut norm,
                                                             const int* progress, int col_blocks, const int* prepared,
                                                             int prep_blocks) {
  extern __shared__ float4 sm4[];
  constexpr int kOut = 64, ldc = kOut + 8;
  const int dkp = state_rows(dk), dv8 = value_cols(dv), ldq = dkp + 8;
  bf16* Qs = reinterpret_cast<bf16*>(sm4);  // {hi, lo} x [64][ldq]
  bf16* Ss = Qs + 2 * kChunk * ldq;         // {hi, lo} x [dkp][ldc] state columns of the pass
  bf16* Us = Qs + chunk_out_front(dkp);     // {hi, lo} x [64][ldc]
  bf16* Ps = Us + 2 * kChunk * ldc;         // {hi, lo} x [64][ldc]
  bf16* Zs = Qs;                            // [64][kZld] z, then w [dv] fp32: after the last Q S0
  float* Ws = reinterpret_cast<float*>(Zs + kChunk * kZld);
  // Blocks in chunk order (the order chunk_state makes them), the value heads of a chunk together.
  const int ci = int(blockIdx.x / unsigned(Hv)), h = int(blockIdx.x % unsigned(Hv));
  const Chunk ch = chunks[ci];
  const int kh = h / (Hv / Hk), L = ch.len, tid = threadIdx.x, passes = (dv + kOut - 1) / kOut;
  // cp.async groups: Q and P; the first S0 columns; U's (after this chunk's chunk_state blocks have
  // published it, when overlapped); later each pass's next S0 (U) columns load once the pass is done
  // reading S0 (U). What the products read past the data is zero.
  const int64_t H0 = (int64_t(ci) * Hv + h) * dkp * dv8, P0 = (int64_t(ci) * Hv + h) * kChunk * kChunk;
  auto load_state = [&](int p) {
    load_split_async(Ss, ldc, dkp * ldc, H_s, dv8, H0 + p * kOut, dkp, min(kOut, dv8 - p * kOut), kOut, dkp);
  };
  auto load_values = [&](int p) {
    load_split_async(Us, ldc, kChunk * ldc, U_s, int64_t(Hv) * dv8, (int64_t(ch.start) * Hv + h) * dv8 + p * kOut, L,
                     min(kOut, dv8 - p * kOut), kOut, kChunk);
  };
  bool all_prepared = false;  // (chunk_prepare may still run beside chunk_state: its Q and P first)
  wait_prepared(prepared, prep_blocks, ci, Hk, kh, all_prepared);
  load_split_async(Qs, ldq, kChunk * ldq, q_s, int64_t(Hk) * dkp, (int64_t(ch.start) * Hk + kh) * dkp, L, dkp, dkp, kChunk);
  load_split_async(Ps, ldc, kChunk * ldc, P_s, kChunk, P0, kChunk, kChunk, kChunk, kChunk);
  mma::cp_async_commit();
  if (progress) {  // this chunk's state and U: every column block of (sequence, h) past chunk ci
    if (tid == 0)
      for (int b = 0; b < col_blocks; ++b)
        while (load_acquire(progress + (int64_t(ch.seq) * Hv + h) * col_blocks + b) <= ci) __nanosleep(200);
    __syncthreads();
  }
  load_state(0);
  mma::cp_async_commit();
  const bool stage = kNorm && reinterpret_cast<uintptr_t>(norm.z) % 16 == 0 && norm.z_stride % 8 == 0 && dv % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(norm.w) % 16 == 0 && reinterpret_cast<uintptr_t>(norm.y) % 16 == 0;
  auto load_norm = [&] {  // z rows of the chunk (zero past L), w
    const int per_row = dv / 8;
    for (int e = tid; e < kChunk * per_row; e += kThreads) {
      const int r = e / per_row, c = 8 * (e - r * per_row);
      const int64_t tok = int64_t(ch.start) + min(r, L - 1);
      mma::cp_async16(Zs + r * kZld + c, norm.z + tok * norm.z_stride + int64_t(h) * dv + c, r < L);
    }
    for (int c = 4 * tid; c < dv; c += 4 * kThreads) mma::cp_async16(Ws + c, norm.w + c, true);
  };
  load_values(0);
  mma::cp_async_commit();
  const int lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int mt = 16 * (warp / 2), nc = 32 * (warp % 2);
  const int r0 = mt + g, r1 = r0 + 8;
  const float e0 = r0 < L ? __expf(G_in[int64_t(ch.start + r0) * Hv + h]) : 0.f;
  const float e1 = r1 < L ? __expf(G_in[int64_t(ch.start + r1) * Hv + h]) : 0.f;
  // acc[p] += A B over k < K: A [16 rows from mt][k] row-major (its low part 64 rows on), B [k][32
  // columns from nc] row-major (its low part b_rows rows on); mma_3xbf16's small terms go to lo.
  float acc[2][4][4] = {};
  auto product = [&](float (&out)[4][4], const bf16* A, int lda, const bf16* B, int b_rows, int K) {
    float lo[4][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < K; k0 += 16)
      mma::mma_step_3xbf16<2>(out, lo, A, lda, kChunk * lda, mt, B, ldc, b_rows * ldc, nc, k0, lane);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) out[nt][e] += lo[nt][e];
  };
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    if (p == passes) break;
    mma::cp_async_wait<1>();  // Q, P and this pass's S0
    __syncthreads();
    product(acc[p], Qs, ldq, Ss, dkp, dkp);  // Q S0
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      acc[p][nt][0] *= e0, acc[p][nt][1] *= e0;
      acc[p][nt][2] *= e1, acc[p][nt][3] *= e1;
    }
    __syncthreads();  // every warp is done with S0 (and, after the last pass's, with Q)
    if (p + 1 < passes)
      load_state(p + 1);
    else if (stage)
      load_norm();
    mma::cp_async_commit();
    mma::cp_async_wait<1>();  // this pass's U
    __syncthreads();
    // + P U (P lower triangular; U's rows past L zero)
    product(acc[p], Ps, ldc, Us, kChunk, min((L + 15) / 16 * 16, mt + 16));
    __syncthreads();  // every warp is done with U
    if (p + 1 < passes) load_values(p + 1);
    mma::cp_async_commit();
  }
  // f(acc fragment, column) for each of this lane's column pairs (col < dv) of every pass.
  auto each_pair = [&](auto f) {
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = kOut * p + nc + 8 * nt + 2 * t;
        if (p < passes && col < dv) f(acc[p][nt], col);  // dv and col are even
      }
  };
  if constexpr (kNorm) {
    // Rows r0 and r1: sums of squares over this lane's columns, its quad, then the warp pair.
    float ss[2] = {0.f, 0.f};
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ss[e / 2] += acc[p][nt][e] * acc[p][nt][e];  // zero past dv and in pass passes
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      ss[i] += __shfl_xor_sync(0xffffffffu, ss[i], 1);
      ss[i] += __shfl_xor_sync(0xffffffffu, ss[i], 2);
    }
    float* rows = reinterpret_cast<float*>(Ps);  // [2][64]: each warp half's row sums (P is read)
    if (t == 0) rows[64 * (warp % 2) + r0] = ss[0], rows[64 * (warp % 2) + r1] = ss[1];
    mma::cp_async_wait<0>();  // z and w (staged)
    __syncthreads();
    const float s0 = rsqrtf((rows[r0] + rows[64 + r0]) / float(dv) + norm.eps);
    const float s1 = rsqrtf((rows[r1] + rows[64 + r1]) / float(dv) + norm.eps);
    each_pair([&](const float(&a)[4], int col) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = half ? r1 : r0;
        if (r >= L) continue;
        const int64_t tok = ch.start + r;
        float2 z, w;
        if (stage) {
          z = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Zs + r * kZld + col));
          w = *reinterpret_cast<const float2*>(Ws + col);
        } else {
          const bf16* zg = norm.z + tok * norm.z_stride + int64_t(h) * dv + col;
          z = make_float2(__bfloat162float(zg[0]), __bfloat162float(zg[1]));
          w = make_float2(norm.w[col], norm.w[col + 1]);
        }
        const float s = half ? s1 : s0;
        const __nv_bfloat162 y = __floats2bfloat162_rn(gated_norm(w.x, a[2 * half], s, z.x),
                                                       gated_norm(w.y, a[2 * half + 1], s, z.y));
        // Staged: over its own z, for the whole-row 16-byte stores below (measured faster than bf16
        // pairs stored from the fragments).
        *reinterpret_cast<__nv_bfloat162*>(stage ? Zs + r * kZld + col : norm.y + (tok * Hv + h) * dv + col) = y;
      }
    });
    if (stage) {
      __syncthreads();
      const int per_row = dv / 8;
      for (int e = tid; e < kChunk * per_row; e += kThreads) {
        const int r = e / per_row, c = 8 * (e - r * per_row);
        if (r < L)
          *reinterpret_cast<uint4*>(norm.y + ((int64_t(ch.start) + r) * Hv + h) * dv + c) =
              *reinterpret_cast<const uint4*>(Zs + r * kZld + c);
      }
    }
  } else {
    each_pair([&](const float(&a)[4], int col) {
      if (r0 < L)
        *reinterpret_cast<float2*>(o + (int64_t(ch.start + r0) * Hv + h) * dv + col) = make_float2(a[0], a[1]);
      if (r1 < L)
        *reinterpret_cast<float2*>(o + (int64_t(ch.start + r1) * Hv + h) * dv + col) = make_float2(a[2], a[3]);
    });
  }
}

/// Row r's z (row r = token r / heads, head r % heads): token rows z_stride apart.
__device__ __forceinline__ const bf16* z_row(const bf16* z, int64_t r, int heads, int64_t z_stride, int n) {
  return z + (r / heads) * z_stride + (r % heads) * int64_t(n);
}

/// A warp per row of n values: y = w * x * rsqrt(mean(x^2) + eps) * silu(z).
__global__ void gated_rms_norm_kernel(const float* x, const bf16* z, int heads, int64_t z_stride, const float* w,
                                      bf16* y, int64_t rows, int n, float eps) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float* xr = x + r * n;
  const bf16* zr = z_row(z, r, heads, z_stride, n);
  float ss = 0.f;
  for (int i = lane; i < n; i += 32) ss += xr[i] * xr[i];
  const float s = rsqrtf(warp_sum(ss) / float(n) + eps);
  for (int i = lane; i < n; i += 32)
    y[r * n + i] = __float2bfloat16_rn(gated_norm(w[i], xr[i], s, __bfloat162float(zr[i])));
}

/// The same for n = 128 V (x, w 16-byte aligned, z and y 8-byte): lane l holds columns 4 (l + 32 v)
/// .. + 3 (v < V), x and z loaded at once (2 V loads in flight per lane), y written 8 bytes per lane.
template <int V>
__global__ void gated_rms_norm_vec_kernel(const float* x, const bf16* z, int heads, int64_t z_stride, const float* w,
                                          bf16* y, int64_t rows, float eps) {
  constexpr int n = 128 * V;
  const int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float4 xv[V];
  uint2 zv[V];  // 4 bf16
#pragma unroll
  for (int v = 0; v < V; ++v) {
    xv[v] = reinterpret_cast<const float4*>(x + r * n)[lane + 32 * v];
    zv[v] = reinterpret_cast<const uint2*>(z_row(z, r, heads, z_stride, n))[lane + 32 * v];
  }
  float ss = 0.f;
#pragma unroll
  for (int v = 0; v < V; ++v) ss += xv[v].x * xv[v].x + xv[v].y * xv[v].y + xv[v].z * xv[v].z + xv[v].w * xv[v].w;
  const float s = rsqrtf(warp_sum(ss) / float(n) + eps);
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int i = 4 * (lane + 32 * v);
    const float4 wv = *reinterpret_cast<const float4*>(w + i);
    const float2 z01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zv[v].x));
    const float2 z23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zv[v].y));
    const __nv_bfloat162 lo =
        __floats2bfloat162_rn(gated_norm(wv.x, xv[v].x, s, z01.x), gated_norm(wv.y, xv[v].y, s, z01.y));
    const __nv_bfloat162 hi =
        __floats2bfloat162_rn(gated_norm(wv.z, xv[v].z, s, z23.x), gated_norm(wv.w, xv[v].w, s, z23.y));
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo), packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(y + r * n + i) = packed;
  }
}

}  // namespace

namespace {
/// Shared memory one block of the current device may opt in to, in bytes.
size_t device_shared_limit() {
  int dev = 0, optin = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return size_t(optin);
}

/// Lets `kernel` use `bytes` of dynamic shared memory; a device offering less is refused with the
/// numbers. (The attribute is per kernel and device: callers on one device with other head dims
/// would race on it, which a process serving one target never does.)
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes, const char* what) {
  const size_t optin = device_shared_limit();
  if (bytes > optin)
    throw std::runtime_error(std::string("gated_delta_rule_chunked: ") + what + " needs " + std::to_string(bytes) +
                             " bytes of shared memory per block for these head dims and Hv / Hk; this GPU offers " +
                             std::to_string(optin) + " (A100 / H100 / H200: 166-232 KB)");
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}
}  // namespace

namespace {
/// The two device buffers of a Split, n values each (stream-ordered); zeroed when `zero`.
struct SplitBuffer {
  StreamBuffer<bf16> hi, lo;
  SplitBuffer(size_t n, bool zero, cudaStream_t stream) : hi(n, stream), lo(n, stream) {
    if (zero && n)
      for (auto* b : {&hi, &lo}) DFLASH_CUDA_CHECK(cudaMemsetAsync(b->data(), 0, n * sizeof(bf16), stream));
  }
  Split get() { return {hi.data(), lo.data()}; }
};
}  // namespace

std::vector<int32_t> sequence_starts(const std::vector<int64_t>& cu) {
  if (!cu.empty() && cu.back() > INT32_MAX)
    throw std::invalid_argument("sequence_starts: " + std::to_string(cu.back()) + " rows do not fit int32");
  std::vector<int32_t> r(cu.empty() ? 0 : size_t(cu.back()));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) r[size_t(t)] = int32_t(cu[s]);
  return r;
}

void causal_conv1d_silu(const bf16* x, int64_t x_stride, const float* w, const int32_t* row_start, int64_t T,
                        int64_t C, int K, float* y, cudaStream_t stream, const ConvQkNorm* qk) {
  if (K < 1 || K > 8 || C <= 0 || T < 0 || x_stride < C)
    throw std::invalid_argument("causal_conv1d_silu: kernel size " + std::to_string(K) + " (1..8), channels " +
                                std::to_string(C) + ", input row stride " + std::to_string(x_stride) +
                                " (>= channels)");
  if (qk && (qk->Hk <= 0 || qk->dk <= 0 || qk->dk > 256 || 2 * int64_t(qk->Hk) * qk->dk > C || !qk->q || !qk->k))
    throw std::invalid_argument("causal_conv1d_silu: query / key norm over " + std::to_string(qk->Hk) +
                                " heads of " + std::to_string(qk->dk) + " (dk <= 256; 2 Hk dk <= " +
                                std::to_string(C) + " channels; q and k given)");
  if (T == 0) return;
  // Four channels per thread (8-byte loads, 16-byte stores) where the layout allows; the l2norm in the
  // same kernel where a head is an aligned group of lanes.
  const bool vec4 = C % 4 == 0 && x_stride % 4 == 0 && aligned_to(8, x) && aligned_to(16, y);
  const bool fused = qk && vec4 && qk->dk % 4 == 0 && qk->dk <= 128 && (qk->dk & (qk->dk - 1)) == 0 &&
                     aligned_to(16, qk->q, qk->k);
  const int64_t per_block = vec4 ? 1024 : 256;
  if ((C + per_block - 1) / per_block > 65535)
    throw std::invalid_argument("causal_conv1d_silu: " + std::to_string(C) + " channels");
  const dim3 grid(unsigned((T + kConvRun - 1) / kConvRun), unsigned((C + per_block - 1) / per_block));
  const ConvQkNorm norm = fused ? *qk : ConvQkNorm{};
  auto launch = [&](auto kernel) { kernel<<<grid, 256, 0, stream>>>(x, x_stride, w, row_start, T, C, y, norm); };
  switch (K) {
#define DFLASH_CONV_CASE(k)                    \
  case k:                                      \
    if (fused)                                 \
      launch(conv1d_silu_kernel<k, 4, true>);  \
    else if (vec4)                             \
      launch(conv1d_silu_kernel<k, 4, false>); \
    else                                       \
      launch(conv1d_silu_kernel<k, 1, false>); \
    break;
    DFLASH_CONV_CASE(1) DFLASH_CONV_CASE(2) DFLASH_CONV_CASE(3) DFLASH_CONV_CASE(4)
    DFLASH_CONV_CASE(5) DFLASH_CONV_CASE(6) DFLASH_CONV_CASE(7) DFLASH_CONV_CASE(8)
#undef DFLASH_CONV_CASE
  }
  DFLASH_CUDA_CHECK_LAUNCH();
  if (qk && !fused) {
    qk_l2norm_kernel<<<unsigned(T), 256, 0, stream>>>(y, C, *qk);
    DFLASH_CUDA_CHECK_LAUNCH();
  }
}

void gdn_prepare(const float* qkv, const bf16* b, const bf16* a, int64_t ba_stride, const float* A_log,
                 const float* dt_bias, int64_t T, int Hk, int Hv, int dk, int dv, float scale, float* q, float* k,
                 float* v, float* g, float* beta, cudaStream_t stream) {
  if (Hk <= 0 || Hv % Hk != 0 || dk <= 0 || dk > 256 || dv <= 0 || ba_stride < Hv)
    throw std::invalid_argument("gdn_prepare: Hk " + std::to_string(Hk) + ", Hv " + std::to_string(Hv) + ", dk " +
                                std::to_string(dk) + " (<= 256), dv " + std::to_string(dv) + ", b / a row stride " +
                                std::to_string(ba_stride) + " (>= Hv)");
  if (!q != !k)
    throw std::invalid_argument("gdn_prepare: q and k are written together (both given or both null)");
  if (T == 0) return;
  gdn_prepare_kernel<<<unsigned(T), 256, 0, stream>>>(qkv, b, a, ba_stride, A_log, dt_bias, Hk, Hv, dk, dv, scale, q, k,
                                                      v, g, beta);
  DFLASH_CUDA_CHECK_LAUNCH();
}

GdnChunkPlan::GdnChunkPlan(const std::vector<int64_t>& cu, cudaStream_t stream) {
  if (cu.size() < 2 || cu.front() != 0)
    throw std::invalid_argument("gated_delta_rule_chunked: " + std::to_string(cu.size()) +
                                " cu_seqlens entries (need n + 1 >= 2, from 0)");
  nseq = int(cu.size()) - 1;
  T = cu.back();
  if (T > INT32_MAX / 2)
    throw std::invalid_argument("gated_delta_rule_chunked: " + std::to_string(T) + " tokens do not fit int32 indices");
  std::vector<Chunk> list;
  std::vector<int32_t> fst{0};
  for (int s = 0; s < nseq; ++s) {
    if (cu[size_t(s) + 1] < cu[size_t(s)]) throw std::invalid_argument("gated_delta_rule_chunked: cu_seqlens decrease");
    for (int64_t t = cu[size_t(s)]; t < cu[size_t(s) + 1]; t += kChunk)
      list.push_back({int32_t(t), int32_t(std::min<int64_t>(kChunk, cu[size_t(s) + 1] - t)), s});
    fst.push_back(int32_t(list.size()));
  }
  count = int64_t(list.size());
  chunks = upload(list, stream);
  first = upload(fst, stream);
}

void gated_delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                              const std::vector<int64_t>& cu, int Hk, int Hv, int dk, int dv, const float* init,
                              float* final_state, float* o, cudaStream_t stream) {
  const GdnChunkPlan plan(cu, stream);
  gated_delta_rule_chunked(q, k, v, g, beta, plan, Hk, Hv, dk, dv, init, final_state, o, stream);
}

bool gdn_projections_fuse(const GdnProjections& p, int dk) {
  return p.K == 4 && dk > 0 && (dk & (dk - 1)) == 0 && p.x_stride % 4 == 0 && aligned_to(8, p.x);
}

GdnChunkState gdn_chunk_state_kernel(int nseq, int Hv, int dk, int dv, size_t shared_limit) {
  // The tensor-core kernel with 64 state columns per block, or 32 when that still fits one wave (one
  // block per SM) and 64 would leave SMs idle (the chain of chunks is the critical path), or when
  // only 32 fit in shared memory; 64 columns at dkp 128 on Hopper run on warpgroup MMAs. GPUs with
  // less shared memory per block than either needs (A100 at dk 128) run the SIMT kernel.
  int dev = 0, sms = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const size_t limit = shared_limit ? std::min(shared_limit, device_shared_limit()) : device_shared_limit();
  const bool narrow = int64_t(nseq) * Hv * ((dv + 31) / 32) <= sms || chunk_state_smem(dk, kMaxCols) > limit;
  if (!narrow && state_rows(dk) == 128 && chunk_state_wgmma_smem() <= limit && runs_sm90a())
    return GdnChunkState::kWgmma;
  if (chunk_state_smem(dk, narrow ? 32 : kMaxCols) > limit) return GdnChunkState::kSimt;
  return narrow ? GdnChunkState::kMma32 : GdnChunkState::kMma64;
}

namespace {
/// Elements of the temporaries of one gated_delta_rule_chunked call: what the call allocates on its
/// stream, and what gated_delta_rule_chunked_workspace_bytes adds up. tc: a tensor-core chunk_state
/// (else SIMT); apart: the projections' conv1d, l2norm and gates run by their own kernels first.
struct ChunkedTemps {
  int64_t conv = 0, cq = 0, ck = 0, cg = 0, cbeta = 0, w = 0, u = 0, G = 0;  // f32
  int64_t w_s = 0, k_s = 0, q_s = 0, P_s = 0, H_s = 0, U_s = 0;              // bf16 pairs (Split: hi and lo)
  int64_t prepared = 0, progress = 0;                                         // int
  ChunkedTemps(int64_t T, int64_t nch, int64_t nseq, int64_t Hk, int64_t Hv, int dk, int dv, bool tc, bool apart,
               bool overlap, bool overlap_prep, int col_blocks) {
    const int64_t C = 2 * Hk * dk + Hv * dv, dkp = state_rows(dk), dv8 = value_cols(dv);
    if (apart) conv = T * C, cq = T * Hk * dk, ck = T * Hk * dk, cg = T * Hv, cbeta = T * Hv;
    w = tc ? 0 : T * Hv * dk, u = T * Hv * dv, G = T * Hv;
    w_s = tc ? T * Hv * dkp : 0, k_s = tc ? T * Hk * dkp : 0, q_s = T * Hk * dkp, P_s = nch * Hv * kChunk * kChunk;
    H_s = nch * Hv * dkp * dv8, U_s = T * Hv * dv8;
    prepared = overlap_prep ? nch * Hk + 1 : 0, progress = overlap ? nseq * Hv * col_blocks : 0;
  }
  int64_t bytes() const {
    return 4 * (conv + cq + ck + cg + cbeta + w + u + G) + 2 * 2 * (w_s + k_s + q_s + P_s + H_s + U_s) +
           4 * (prepared + progress);
  }
};
}  // namespace

int64_t gated_delta_rule_chunked_workspace_bytes(int64_t T, int64_t nseq, int Hk, int Hv, int dk, int dv) {
  const int64_t nch = (T + kChunk - 1) / kChunk + nseq;  // each sequence's last chunk may be partial
  int64_t most = 0;
  for (bool tc : {false, true}) {
    const int kc = tc ? 32 : kSimtCols;  // (the mma chunk_state takes 32 or 64 columns: the most blocks)
    most = std::max(most, ChunkedTemps(T, nch, nseq, Hk, Hv, dk, dv, tc, true, true, tc, (dv + kc - 1) / kc).bytes());
  }
  return most;
}

void gated_delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                              const GdnChunkPlan& plan, int Hk, int Hv, int dk, int dv, const float* init,
                              float* final_state, float* o, cudaStream_t stream, size_t shared_limit,
                              int64_t v_row_stride, const GatedNormOut* norm, const GdnProjections* from) {
  if (Hk <= 0 || Hv <= 0 || Hv % Hk != 0 || dk <= 0 || dk > 128 || dv <= 0 || dv > 128 || dk % 4 || dv % 4)
    throw std::invalid_argument("gated_delta_rule_chunked: Hk " + std::to_string(Hk) + ", Hv " + std::to_string(Hv) +
                                ", dk " + std::to_string(dk) + ", dv " + std::to_string(dv) +
                                " (head dims multiples of 4, <= 128)");
  if (!from && v_row_stride != 0 && (v_row_stride < int64_t(Hv) * dv || v_row_stride % 4 != 0 ||
                            reinterpret_cast<uintptr_t>(v) % 16 != 0))
    throw std::invalid_argument("gated_delta_rule_chunked: v row stride " + std::to_string(v_row_stride) +
                                " (>= Hv dv = " + std::to_string(int64_t(Hv) * dv) +
                                ", a multiple of 4, v 16-byte aligned)");
  if (norm && (!norm->z || !norm->w || !norm->y || !aligned_to(4, norm->y) || norm->z_stride < int64_t(Hv) * dv))
    throw std::invalid_argument("gated_delta_rule_chunked: the gated RMSNorm needs z, w and y (4-byte aligned), and a "
                                "z row stride " + std::to_string(norm ? norm->z_stride : 0) + " >= Hv dv = " +
                                std::to_string(int64_t(Hv) * dv));
  const int64_t C = 2 * int64_t(Hk) * dk + int64_t(Hv) * dv;
  if (from && (!from->x || !from->conv_w || !from->b || !from->a || !from->A_log || !from->dt_bias ||
               !from->row_start || from->x_stride < C || from->ba_stride < Hv))
    throw std::invalid_argument("gated_delta_rule_chunked: the projections need x (row stride " +
                                std::to_string(from->x_stride) + " >= " + std::to_string(C) +
                                "), conv_w, b, a (row stride >= Hv), A_log, dt_bias and row_start");
  const int nseq = plan.nseq;
  const int64_t T = plan.T, nch = plan.count;
  if (nch * Hv > INT32_MAX)
    throw std::invalid_argument("gated_delta_rule_chunked: " + std::to_string(nch) + " chunks x " + std::to_string(Hv) +
                                " value heads exceed one launch's blocks");
  const Chunk* d_chunks = plan.chunks.data();
  const int32_t* d_first = plan.first.data();
  const int dkp = state_rows(dk);
  int dev = 0, major = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  const size_t limit = shared_limit ? std::min(shared_limit, device_shared_limit()) : device_shared_limit();
  const GdnChunkState which = gdn_chunk_state_kernel(nseq, Hv, dk, dv, shared_limit);
  const bool tc = which != GdnChunkState::kSimt;
  const int cols = which == GdnChunkState::kMma32 ? 32 : kMaxCols;
  const size_t smem_tc = which == GdnChunkState::kWgmma ? chunk_state_wgmma_smem() : chunk_state_smem(dk, cols);
  const size_t smem_simt =
      (dk * kSimtCols + 2 * kChunk * (dk + 4) + 2 * kChunk * (kSimtCols + 4) + 3 * kChunk) * sizeof(float);
  if (!tc && smem_simt > limit)
    throw std::runtime_error("gated_delta_rule_chunked: chunk_state needs " + std::to_string(smem_simt) +
                             " bytes of shared memory per block for these head dims; " + std::to_string(limit) +
                             " are available");
  // From the projections: conv1d, l2norm and gates inside chunk_prepare where its kernel covers the
  // shapes (and chunk_state, the tensor-core one, reads no fp32 keys), else by their own kernels into
  // q, k, v (the conv output's v columns, read in place), g, beta.
  const bool fuse = from && tc && gdn_projections_fuse(*from, dk);
  const bool apart = from && !fuse && T > 0;
  const int kc = tc ? cols : kSimtCols, col_blocks = (dv + kc - 1) / kc;
  const bool overlap = major >= 9 && nch > 0, overlap_prep = overlap && tc;
  const ChunkedTemps z(T, nch, nseq, Hk, Hv, dk, dv, tc, apart, overlap, overlap_prep, col_blocks);
  StreamBuffer<float> conv(size_t(z.conv), stream), cq(size_t(z.cq), stream), ck(size_t(z.ck), stream),
      cg(size_t(z.cg), stream), cbeta(size_t(z.cbeta), stream);
  if (apart) {
    const ConvQkNorm qk{Hk, dk, from->q_scale, cq.data(), ck.data()};
    causal_conv1d_silu(from->x, from->x_stride, from->conv_w, from->row_start, T, C, from->K, conv.data(), stream, &qk);
    gdn_prepare(conv.data(), from->b, from->a, from->ba_stride, from->A_log, from->dt_bias, T, Hk, Hv, dk, dv,
                from->q_scale, nullptr, nullptr, nullptr, cg.data(), cbeta.data(), stream);
    q = cq.data(), k = ck.data(), v = conv.data() + 2 * int64_t(Hk) * dk, g = cg.data(), beta = cbeta.data();
    v_row_stride = C;
  }
  // Empty sequences still pass their initial state through (chunk_state runs no chunk for them).
  // w in fp32 for the SIMT chunk_state; for the tensor-core one, w and k split. Padding the products
  // read and no kernel writes is zeroed: the split w's columns dk .. dkp - 1 (chunk_prepare writes
  // q's and k's as zeros) and, after the SIMT chunk_state, H's rows dk .. dkp - 1 and H / U's columns
  // dv .. dv8 - 1.
  const int dv8 = value_cols(dv);
  const bool pad_k = dkp != dk, pad_simt = !tc && (pad_k || dv8 != dv);
  StreamBuffer<float> w(size_t(z.w), stream), u(size_t(z.u), stream), G(size_t(z.G), stream);
  SplitBuffer w_s(size_t(z.w_s), pad_k, stream), k_s(size_t(z.k_s), false, stream), q_s(size_t(z.q_s), false, stream),
      P_s(size_t(z.P_s), false, stream);
  // On sm_90+ the kernels overlap (see publish_prepared): prepared [nch Hk + 1] flags chunk_prepare's
  // blocks done and counts them, for the tensor-core chunk_state; progress [nseq, Hv, col_blocks]
  // counts each chunk_state block's chunks in memory, for chunk_out. (These and chunk_state's outputs
  // H_s, U_s are allocated and zeroed before chunk_prepare: nothing may come between the kernels of a
  // programmatic launch.)
  SplitBuffer H_s(size_t(z.H_s), pad_simt, stream), U_s(size_t(z.U_s), pad_simt, stream);
  const int prep_blocks = int(nch * Hk);
  StreamBuffer<int> prepared(size_t(z.prepared), stream);
  StreamBuffer<int> progress(size_t(z.progress), stream);
  if (overlap_prep) DFLASH_CUDA_CHECK(cudaMemsetAsync(prepared.data(), 0, prepared.size() * sizeof(int), stream));
  if (overlap) DFLASH_CUDA_CHECK(cudaMemsetAsync(progress.data(), 0, progress.size() * sizeof(int), stream));
  if (nch) {
    const size_t smem = prepare_smem(dk, dv, Hv / Hk, fuse ? from->K : 0);
    auto prepare = fuse ? chunk_prepare_kernel<4> : chunk_prepare_kernel<0>;
    allow_shared_memory(prepare, smem, "chunk_prepare");
    prepare<<<unsigned(prep_blocks), kThreads, smem, stream>>>(
        q, k, v, g, beta, d_chunks, Hk, Hv, dk, dv, dkp, w.data(), w_s.get(), k_s.get(), q_s.get(), u.data(), P_s.get(),
        G.data(), v_row_stride, fuse ? *from : GdnProjections{}, overlap_prep ? prepared.data() : nullptr);
    DFLASH_CUDA_CHECK_LAUNCH();
  }
  // The sequential part: states before each chunk and the chunks' U.
  int* const prog = overlap ? progress.data() : nullptr;
  const dim3 state_grid{unsigned(nseq), unsigned(Hv), unsigned(col_blocks)};
  auto launch_tc = [&](auto kernel) {
    allow_shared_memory(kernel, smem_tc, "chunk_state");
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
    DFLASH_CUDA_CHECK(launch_programmatic(kernel, state_grid, smem_tc, stream, overlap_prep, k_s.get(), w_s.get(),
                                          static_cast<const float*>(u.data()), static_cast<const float*>(G.data()),
                                          d_chunks, d_first, Hk, Hv, dk, dv, init, final_state, H_s.get(), U_s.get(),
                                          prog, static_cast<const int*>(overlap_prep ? prepared.data() : nullptr),
                                          prep_blocks));
  };
  if (which == GdnChunkState::kWgmma) {
    launch_tc(chunk_state_wgmma_kernel);
  } else if (which == GdnChunkState::kMma32) {
    launch_tc(chunk_state_kernel<32>);
  } else if (which == GdnChunkState::kMma64) {
    launch_tc(chunk_state_kernel<kMaxCols>);
  } else {
    allow_shared_memory(chunk_state_simt_kernel, smem_simt, "chunk_state");
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(chunk_state_simt_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
    chunk_state_simt_kernel<<<state_grid, kThreads, smem_simt, stream>>>(k, w.data(), u.data(), G.data(), d_chunks,
                                                                         d_first, Hk, Hv, dk, dv, init, final_state,
                                                                         H_s.get(), U_s.get(), prog);
  }
  DFLASH_CUDA_CHECK_LAUNCH();
  if (!nch) return;
  // The outputs, every chunk in parallel: blocks in chunk order, a chunk's value heads together.
  const size_t smem_out = chunk_out_smem(dk);
  auto launch_out = [&](auto kernel) {
    allow_shared_memory(kernel, smem_out, "chunk_out");
    DFLASH_CUDA_CHECK(launch_programmatic(kernel, dim3(unsigned(nch * Hv)), smem_out, stream, overlap, q_s.get(),
                                          H_s.get(), U_s.get(), P_s.get(), static_cast<const float*>(G.data()),
                                          d_chunks, Hk, Hv, dk, dv, o, norm ? *norm : GatedNormOut{},
                                          static_cast<const int*>(prog), col_blocks,
                                          static_cast<const int*>(overlap_prep ? prepared.data() : nullptr), prep_blocks));
  };
  if (norm)
    launch_out(chunk_out_kernel<true>);
  else
    launch_out(chunk_out_kernel<false>);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void gated_rms_norm(const float* x, const bf16* z, int64_t heads, int64_t z_stride, const float* w, bf16* y,
                    int64_t rows, int64_t n, double eps, cudaStream_t stream) {
  if (n <= 0 || rows < 0 || heads <= 0 || heads > INT32_MAX || z_stride < heads * n)
    throw std::invalid_argument("gated_rms_norm: rows " + std::to_string(rows) + ", n " + std::to_string(n) +
                                ", heads " + std::to_string(heads) + ", z row stride " + std::to_string(z_stride) +
                                " (>= heads n)");
  if (rows == 0) return;
  const unsigned blocks = unsigned((rows + 7) / 8);
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0 &&
                       (reinterpret_cast<uintptr_t>(z) | reinterpret_cast<uintptr_t>(y)) % 8 == 0 && z_stride % 4 == 0;
  if (aligned && n == 128)
    gated_rms_norm_vec_kernel<1><<<blocks, 256, 0, stream>>>(x, z, int(heads), z_stride, w, y, rows, float(eps));
  else if (aligned && n == 256)
    gated_rms_norm_vec_kernel<2><<<blocks, 256, 0, stream>>>(x, z, int(heads), z_stride, w, y, rows, float(eps));
  else
    gated_rms_norm_kernel<<<blocks, 256, 0, stream>>>(x, z, int(heads), z_stride, w, y, rows, int(n), float(eps));
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
