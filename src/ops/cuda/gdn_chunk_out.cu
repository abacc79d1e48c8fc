// chunk_out, the last kernel of the chunked gated delta rule (gdn_common.cuh has the math): every
// chunk's outputs O = diag(exp(G)) Q S0 + P U in parallel, with the layer's gated RMSNorm applied
// on the way out when asked (GatedNormOut). Launched by gdn_dispatch.cu (launch_chunk_out,
// gdn_kernels.h).
#include "ops/cuda/gdn_common.cuh"

namespace dflash::cuda::detail {

namespace {

constexpr int kZld = 128 + 8;  // bf16 row stride of chunk_out's z tile (conflict-free bf16x2 reads)

/// bf16 elements of chunk_out_kernel's front region: split Q [64][dkp + 8] and S0 [dkp][72] (two
/// parts each), which the gated RMSNorm's z tile [64][kZld] and w [128] fp32 reuse once the last
/// product with S0 is done (at least that much).
__host__ __device__ constexpr int chunk_out_front(int dkp) {
  const int qs = 2 * (kChunk * (dkp + 8) + dkp * 72), zw = kChunk * kZld + 2 * 128;
  return qs > zw ? qs : zw;
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

}  // namespace

/// Shared memory of chunk_out_kernel at key dim dk, in bytes: the front region, then split U [64][72]
/// and P [64][72] (S0 and U hold 64 value columns at a time).
size_t chunk_out_smem(int dk) {
  return size_t(chunk_out_front(state_rows(dk)) + 2 * 2 * kChunk * 72) * sizeof(bf16);
}

void launch_chunk_out(const GatedNormOut* norm, Split q_s, Split H_s, Split U_s, Split P_s, const float* G,
                      const GdnChunk* chunks, int64_t nch, int Hk, int Hv, int dk, int dv, float* o,
                      const int* progress, int col_blocks, const int* prepared, int prep_blocks, bool programmatic,
                      cudaStream_t stream) {
  const size_t smem = chunk_out_smem(dk);
  auto launch = [&](auto kernel) {
    allow_shared_memory(reinterpret_cast<const void*>(kernel), smem, "chunk_out");
    DFLASH_CUDA_CHECK(launch_programmatic(kernel, dim3(unsigned(nch * Hv)), smem, stream, programmatic, q_s, H_s, U_s,
                                          P_s, G, chunks, Hk, Hv, dk, dv, o, norm ? *norm : GatedNormOut{}, progress,
                                          col_blocks, prepared, prep_blocks));
  };
  if (norm)
    launch(chunk_out_kernel<true>);
  else
    launch(chunk_out_kernel<false>);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda::detail
