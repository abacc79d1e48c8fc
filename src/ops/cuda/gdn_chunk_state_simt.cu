// chunk_state in fp32 SIMT, for GPUs with too little shared memory per block for the tensor-core
// forms (A100 at dk 128): the sequential part of the chunked gated delta rule (gdn_common.cuh has
// the math). Launched by gdn_dispatch.cu (launch_chunk_state_simt, gdn_kernels.h).
#include "ops/cuda/gdn_common.cuh"

namespace dflash::cuda::detail {

namespace {

/// The chunk_state of GPUs with less shared memory than the tensor-core kernel below needs (A100:
/// 163 KB per block; about 103 KB here at dk 128), fp32 SIMT. One block per (sequence, value head,
/// 32 state columns): walks the sequence's chunks in order and
/// keeps only what is sequential: saves the state before each chunk (H_s, split, [chunks, Hv, dkp,
/// dv8]), the chunk's U = u - w S0 (U_s, split, [T, Hv, dv8]), then S = exp(G_L) S0 +
/// (diag(exp(G_L - G)) K)^T U. Loads run ahead of the math (cp.async): the chunk's keys while U is computed, the next chunk's w,
/// u and gates while the state is updated. Thread tiles: U rows ur + 32 r (r < 2) x columns
/// 4 cp .. 4 cp + 3; S rows 4 ur .. 4 ur + 3 x the same columns. progress as chunk_state_kernel's
/// (gdn_chunk_state_mma.cu).
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

}  // namespace

size_t chunk_state_simt_smem(int dk) {
  return (dk * kSimtCols + 2 * kChunk * (dk + 4) + 2 * kChunk * (kSimtCols + 4) + 3 * kChunk) * sizeof(float);
}

void launch_chunk_state_simt(const ChunkStateArgs& a, cudaStream_t stream) {
  const size_t smem = chunk_state_simt_smem(a.dk);
  allow_shared_memory(reinterpret_cast<const void*>(chunk_state_simt_kernel), smem, "chunk_state");
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(chunk_state_simt_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
  const dim3 grid{unsigned(a.nseq), unsigned(a.Hv), unsigned((a.dv + kSimtCols - 1) / kSimtCols)};
  chunk_state_simt_kernel<<<grid, kThreads, smem, stream>>>(a.k, a.w, a.u, a.G, a.chunks, a.first, a.Hk, a.Hv, a.dk,
                                                            a.dv, a.init, a.final_state, a.H_s, a.U_s, a.progress);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda::detail
