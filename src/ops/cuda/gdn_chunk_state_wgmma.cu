// chunk_state on Hopper (sm_90a, state rows dkp = 128, 64 state columns per block): the same chain
// with warpgroup MMAs reading every operand from shared memory in the 128-byte swizzle (wgmma.cuh),
// so no warp loads fragments and the tensor cores take whole 64-row products. Per chunk, after the
// state before it is split to shared memory: warpgroup 0 computes U = u - w S0 (m64n64, k = 128)
// while warpgroup 1 queues the next chunk's w, k and gates (cp.async; not before the first barrier:
// the proxy fence there would wait for the copies) and loads its u into registers; then both update
// the state, warpgroup w its rows 64 w .. 64 w + 63: S = exp(G_L) S0 + K^T diag(D) U (m64n64, k =
// the chunk's rows, K^T read MN-major), the state as their accumulators (the mma.sync layout of
// gdn_chunk_state_mma.cu's chunk_state_kernel: warp w rows 16 w ..), while every thread stores the
// state before the chunk and U, and warpgroup 1 puts the next u in shared memory. The same 3xBF16
// products as chunk_state_kernel. (The split of work between the barriers follows ncu's stall
// samples: the warpgroup that waits at a barrier has work to take over; the report of commit
// abc5e5e (git history of bench/results).) Launched by gdn_dispatch.cu (launch_chunk_state_wgmma,
// gdn_kernels.h); the math is in gdn_common.cuh.
#include "gpu/wgmma.cuh"
#include "ops/cuda/gdn_common.cuh"

namespace dflash::cuda::detail {

namespace {

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
  load_state_frags(S, init, true, state_off, sm0, g, t, dk, dv, c0, ncols);
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
  if (final_state) store_state_frags(S, final_state, state_off, sm0, g, t, dk, dv, c0, ncols);
}

}  // namespace

/// Shared memory of chunk_state_wgmma_kernel, bytes: bf16 tiles (the split S0 [128][64], w and k in
/// two buffers of [64][128] each, diag(D) U and U [64][64], two parts each), then fp32 u [64][kUld],
/// the gates (2 x 64) and D (64), and up to 1024 bytes to align the tiles.
size_t chunk_state_wgmma_smem() {
  return size_t(2 * 128 * kSw + 2 * 2 * 2 * kChunk * 128 + 2 * 2 * kChunk * kSw) * sizeof(bf16) +
         size_t(kChunk * kUld + 3 * kChunk) * sizeof(float) + 1024;
}

void launch_chunk_state_wgmma(const ChunkStateArgs& a, bool programmatic, cudaStream_t stream) {
  const size_t smem = chunk_state_wgmma_smem();
  allow_shared_memory(reinterpret_cast<const void*>(chunk_state_wgmma_kernel), smem, "chunk_state");
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(chunk_state_wgmma_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
  const dim3 grid{unsigned(a.nseq), unsigned(a.Hv), unsigned((a.dv + kMaxCols - 1) / kMaxCols)};
  DFLASH_CUDA_CHECK(launch_programmatic(chunk_state_wgmma_kernel, grid, smem, stream, programmatic, a.k_s, a.w_s, a.u,
                                        a.G, a.chunks, a.first, a.Hk, a.Hv, a.dk, a.dv, a.init, a.final_state, a.H_s,
                                        a.U_s, a.progress, a.prepared, a.prep_blocks));
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda::detail
