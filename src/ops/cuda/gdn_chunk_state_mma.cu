// chunk_state on tensor cores with mma.sync (3xBF16), 32 or 64 state columns per block: the
// sequential part of the chunked gated delta rule (gdn_common.cuh has the math). Launched by
// gdn_dispatch.cu (launch_chunk_state_mma, gdn_kernels.h).
#include <stdexcept>

#include "ops/cuda/gdn_common.cuh"

namespace dflash::cuda::detail {

namespace {

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
  load_state_frags(S, init, owns, state_off, sm0, g, t, dk, dv, c0, ncols);
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
  if (final_state && owns) store_state_frags(S, final_state, state_off, sm0, g, t, dk, dv, c0, ncols);
}

}  // namespace

/// Shared memory of chunk_state_kernel<cols> at key dim dk, in bytes: the gates (2 x 64) and D (64)
/// in fp32, then in bf16 the split S0 (2 x [dkp][cols + 8]), w and k (2 buffers x 2 parts x
/// [64][dkp + 8] each), U and diag(D) U (2 x [64][cols + 8] each). Row strides 16 bytes past a
/// multiple of 32: every ldmatrix and fragment store is free of bank conflicts.
size_t chunk_state_mma_smem(int dk, int cols) {
  const int dkp = state_rows(dk);
  return size_t(2 * dkp * (cols + 8) + 8 * kChunk * (dkp + 8) + 4 * kChunk * (cols + 8)) * sizeof(bf16) +
         3 * kChunk * sizeof(float);
}

void launch_chunk_state_mma(int cols, const ChunkStateArgs& a, bool programmatic, cudaStream_t stream) {
  if (cols != 32 && cols != kMaxCols) throw std::invalid_argument("chunk_state: 32 or 64 state columns per block");
  auto kernel = cols == 32 ? chunk_state_kernel<32> : chunk_state_kernel<kMaxCols>;
  const size_t smem = chunk_state_mma_smem(a.dk, cols);
  allow_shared_memory(reinterpret_cast<const void*>(kernel), smem, "chunk_state");
  DFLASH_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  const dim3 grid{unsigned(a.nseq), unsigned(a.Hv), unsigned((a.dv + cols - 1) / cols)};
  DFLASH_CUDA_CHECK(launch_programmatic(kernel, grid, smem, stream, programmatic, a.k_s, a.w_s, a.u, a.G, a.chunks,
                                        a.first, a.Hk, a.Hv, a.dk, a.dv, a.init, a.final_state, a.H_s, a.U_s,
                                        a.progress, a.prepared, a.prep_blocks));
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda::detail
