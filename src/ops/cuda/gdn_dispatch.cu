// The chunked gated delta rule's host side (gated_delta_rule.h): the chunk plan, which chunk_state
// form runs, the temporaries, and the launches of chunk_prepare, chunk_state and chunk_out
// (gdn_kernels.h; the math in gdn_common.cuh), overlapped on sm_90+ by programmatic dependent launch.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "gpu/device_info.h"
#include "gpu/vec.cuh"
#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/gdn_kernels.h"

namespace dflash::cuda {

namespace detail {

/// Shared memory one block of the current device may opt in to, in bytes.
size_t device_shared_limit() {
  int dev = 0, optin = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return size_t(optin);
}

void allow_shared_memory(const void* kernel, size_t bytes, const char* what) {
  const size_t optin = device_shared_limit();
  if (bytes > optin)
    throw std::runtime_error(std::string("gated_delta_rule_chunked: ") + what + " needs " + std::to_string(bytes) +
                             " bytes of shared memory per block for these head dims and Hv / Hk; this GPU offers " +
                             std::to_string(optin) + " (A100 / H100 / H200: 166-232 KB)");
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace detail

namespace {

using namespace detail;
using Chunk = GdnChunk;

/// The two device buffers of a Split, n values each (stream-ordered); zeroed when `zero`.
struct SplitBuffer {
  StreamBuffer<bf16> hi, lo;
  SplitBuffer(size_t n, bool zero, cudaStream_t stream) : hi(n, stream), lo(n, stream) {
    if (zero && n)
      for (auto* b : {&hi, &lo}) DFLASH_CUDA_CHECK(cudaMemsetAsync(b->data(), 0, n * sizeof(bf16), stream));
  }
  Split get() { return {hi.data(), lo.data()}; }
};

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
  const bool narrow = int64_t(nseq) * Hv * ((dv + 31) / 32) <= sms || chunk_state_mma_smem(dk, kMaxCols) > limit;
  if (!narrow && state_rows(dk) == 128 && chunk_state_wgmma_smem() <= limit && runs_sm90a())
    return GdnChunkState::kWgmma;
  if (chunk_state_mma_smem(dk, narrow ? 32 : kMaxCols) > limit) return GdnChunkState::kSimt;
  return narrow ? GdnChunkState::kMma32 : GdnChunkState::kMma64;
}

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
  const size_t smem_simt = chunk_state_simt_smem(dk);
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
  if (nch)
    launch_chunk_prepare(fuse ? from->K : 0, q, k, v, g, beta, d_chunks, nch, Hk, Hv, dk, dv, w.data(), w_s.get(),
                         k_s.get(), q_s.get(), u.data(), P_s.get(), G.data(), v_row_stride,
                         fuse ? *from : GdnProjections{}, overlap_prep ? prepared.data() : nullptr, stream);
  // The sequential part: states before each chunk and the chunks' U.
  int* const prog = overlap ? progress.data() : nullptr;
  ChunkStateArgs state;
  state.k = k, state.w = w.data(), state.k_s = k_s.get(), state.w_s = w_s.get();
  state.u = u.data(), state.G = G.data(), state.chunks = d_chunks, state.first = d_first;
  state.nseq = nseq, state.Hk = Hk, state.Hv = Hv, state.dk = dk, state.dv = dv;
  state.init = init, state.final_state = final_state, state.H_s = H_s.get(), state.U_s = U_s.get();
  state.progress = prog, state.prepared = overlap_prep ? prepared.data() : nullptr, state.prep_blocks = prep_blocks;
  if (which == GdnChunkState::kWgmma)
    launch_chunk_state_wgmma(state, overlap_prep, stream);
  else if (which == GdnChunkState::kSimt)
    launch_chunk_state_simt(state, stream);
  else
    launch_chunk_state_mma(cols, state, overlap_prep, stream);
  if (!nch) return;
  // The outputs, every chunk in parallel: blocks in chunk order, a chunk's value heads together.
  launch_chunk_out(norm, q_s.get(), H_s.get(), U_s.get(), P_s.get(), G.data(), d_chunks, nch, Hk, Hv, dk, dv, o, prog,
                   col_blocks, overlap_prep ? prepared.data() : nullptr, prep_blocks, overlap, stream);
}

}  // namespace dflash::cuda
