// chunk_prepare, the first kernel of the chunked gated delta rule (gdn_common.cuh has the math):
// per (chunk, key head) A, T = (I + A)^-1, w, u, the decayed P = Q K^T and the in-chunk gates, with
// the conv1d, l2norm and gates of the projections inside when fused. Launched by gdn_dispatch.cu
// (launch_chunk_prepare, gdn_kernels.h).
#include <stdexcept>

#include "ops/cuda/gdn_common.cuh"

namespace dflash::cuda::detail {

namespace {

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

}  // namespace

/// Shared memory (bytes) of chunk_prepare_kernel for r = Hv / Hk value heads per key head and conv
/// kernel size conv_k (0: no conv inside): about 104 KB at d 128, plus 768 bytes per value head (the
/// gates of all r heads), plus 4 KB of conv weights with conv_k 4; two blocks per SM on H100 / H200 up
/// to r = 12, or r = 7 with the conv.
size_t chunk_prepare_smem(int dk, int dv, int r, int conv_k) {
  return size_t(2 * kChunk * prepare_ld(dk, dv) + 2 * kChunk * (kChunk + 4) + 3 * r * kChunk + kInvScratch +
                2 * conv_k * 128) *
         sizeof(float);
}

void launch_chunk_prepare(int conv_k, const float* q, const float* k, const float* v, const float* g,
                          const float* beta, const GdnChunk* chunks, int64_t nch, int Hk, int Hv, int dk, int dv,
                          float* w_out, Split w_s, Split k_s, Split q_s, float* u_out, Split P_s, float* G_out,
                          int64_t v_stride, const GdnProjections& pj, int* prepared, cudaStream_t stream) {
  if (conv_k != 0 && conv_k != 4) throw std::invalid_argument("chunk_prepare: conv kernel size 0 or 4");
  const size_t smem = chunk_prepare_smem(dk, dv, Hv / Hk, conv_k);
  auto prepare = conv_k ? chunk_prepare_kernel<4> : chunk_prepare_kernel<0>;
  allow_shared_memory(reinterpret_cast<const void*>(prepare), smem, "chunk_prepare");
  prepare<<<unsigned(nch * Hk), kThreads, smem, stream>>>(q, k, v, g, beta, chunks, Hk, Hv, dk, dv, state_rows(dk),
                                                         w_out, w_s, k_s, q_s, u_out, P_s, G_out, v_stride, pj,
                                                         prepared);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda::detail
