#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/cuda/gemm.h"

namespace dflash::cuda {

namespace {

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt: ") + what + " failed with status " + std::to_string(int(s)));
}

// (M, N, K, trans_a, trans_b, out f32, beta != 0, tuned, device kind, fp8 operands): devices of one
// kind share a choice, so that the GPUs of one process compute bitwise alike.
using AlgoKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, bool, bool, bool, int, bool>;
std::mutex g_algo_mutex;
std::map<AlgoKey, cublasLtMatmulAlgo_t> g_algos;   // every shape's choice
std::map<AlgoKey, cublasLtMatmulAlgo_t> g_tuned;   // tuned choices by M bucket (key's M = m_bucket(M))

/// Rows are bucketed for tuning (a packed forward's token count changes from batch to batch): the
/// smallest power of two >= M, at least 16.
int64_t m_bucket(int64_t M) {
  int64_t b = 16;
  while (b < M) b *= 2;
  return b;
}

/// The current device's kind: compute capability x 1000 + multiprocessor count (per thread and device,
/// looked up once).
int device_kind() {
  int device = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<int, int> kinds;
  auto it = kinds.find(device);
  if (it != kinds.end()) return it->second;
  int major = 0, minor = 0, sms = 0;
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return kinds[device] = (major * 10 + minor) * 1000 + sms;
}

constexpr int kCandidates = 8;      // cuBLASLt heuristic candidates timed per shape
constexpr int64_t kTuneMinRows = 512;  // smaller products (decoding, small batches) keep the first choice
constexpr int kTuneRounds = 4;  // round 0 warms up; the minimum of the others counts

/// Index of the fastest of the n candidates h[0..n) for `op` on these very operands, timed by CUDA
/// events on `stream` (synchronizes it). With beta != 0 the candidates accumulate into a scratch copy
/// of C, so C is left as it was; with beta == 0 they overwrite C (the caller's product follows).
/// Candidates cuBLASLt refuses to run are skipped. ms[0..n): each one's time (inf when it did not run).
/// -1 when nothing could be timed (no memory for the scratch copy, a CUDA error): then nothing leaks,
/// the error is cleared and the caller takes cuBLASLt's first choice. Never throws.
int fastest_candidate(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                      cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, const cublasLtMatmulHeuristicResult_t* h,
                      int n, const float* alpha, const float* beta, const void* A, const void* B, void* C,
                      size_t c_bytes, void* workspace, size_t workspace_bytes, cudaStream_t stream, float* ms) {
  struct Scratch {  // freed (stream-ordered) and destroyed on every return
    cudaStream_t s;
    void* c = nullptr;
    std::vector<cudaEvent_t> ev;
    ~Scratch() {
      for (cudaEvent_t e : ev)
        if (e) cudaEventDestroy(e);
      if (c) cudaFreeAsync(c, s);
    }
  } scratch{stream};
  bool fine = true;
  auto ok = [&](cudaError_t e) {
    if (e != cudaSuccess) fine = false, cudaGetLastError();
    return fine;
  };
  void* Ct = C;
  if (*beta != 0.f) {
    if (!ok(cudaMallocAsync(&scratch.c, c_bytes, stream)) ||
        !ok(cudaMemcpyAsync(scratch.c, C, c_bytes, cudaMemcpyDeviceToDevice, stream)))
      return -1;
    Ct = scratch.c;
  }
  scratch.ev.assign(static_cast<size_t>(2 * n), nullptr);
  for (auto& e : scratch.ev)
    if (!ok(cudaEventCreate(&e))) return -1;
  std::fill(ms, ms + n, std::numeric_limits<float>::infinity());
  std::vector<char> ran(static_cast<size_t>(n));
  for (int round = 0; round < kTuneRounds; ++round) {
    for (int i = 0; i < n; ++i) {  // the candidates interleaved, so clock changes hit them alike
      ok(cudaEventRecord(scratch.ev[size_t(2 * i)], stream));
      ran[size_t(i)] = cublasLtMatmul(handle, op, alpha, B, la, A, lb, beta, Ct, lc, Ct, lc, &h[i].algo, workspace,
                                      workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
      ok(cudaEventRecord(scratch.ev[size_t(2 * i + 1)], stream));
    }
    if (!ok(cudaEventSynchronize(scratch.ev.back()))) return -1;
    for (int i = 0; round > 0 && i < n; ++i) {
      float t = 0.f;
      if (ran[size_t(i)] && ok(cudaEventElapsedTime(&t, scratch.ev[size_t(2 * i)], scratch.ev[size_t(2 * i + 1)])))
        ms[i] = std::min(ms[i], t);
    }
  }
  const int pick = int(std::min_element(ms, ms + n) - ms);
  return fine && ms[pick] < std::numeric_limits<float>::infinity() ? pick : -1;
}

}  // namespace

GemmTune gemm_tune_mode() {
  const char* v = std::getenv("DFLASH_GEMM_TUNE");
  if (!v || !*v) return GemmTune::kAuto;
  if (std::strcmp(v, "0") == 0) return GemmTune::kOff;
  if (std::strcmp(v, "1") == 0) return GemmTune::kOn;
  if (std::strcmp(v, "log") == 0) return GemmTune::kLog;
  throw std::invalid_argument(std::string("DFLASH_GEMM_TUNE='") + v + "': expected 0, 1 or log (or unset)");
}

struct GemmContext::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool tune_by_default = false;
};

GemmContext::GemmContext(cudaStream_t stream, size_t workspace_bytes, bool tune_by_default)
    : impl_(new Impl), stream_(stream) {
  impl_->tune_by_default = tune_by_default;
  lt_check(cublasLtCreate(&impl_->handle), "cublasLtCreate");
  impl_->workspace_bytes = workspace_bytes;
  if (workspace_bytes) {
    const cudaError_t e = cudaMalloc(&impl_->workspace, workspace_bytes);
    if (e != cudaSuccess) {
      cublasLtDestroy(impl_->handle);
      check(e, "cudaMalloc(gemm workspace)", __FILE__, __LINE__);
    }
  }
}

GemmContext::~GemmContext() {
  if (impl_->workspace) cudaFree(impl_->workspace);
  if (impl_->handle) cublasLtDestroy(impl_->handle);
}

size_t GemmContext::cached_algorithms() {
  std::lock_guard<std::mutex> lk(g_algo_mutex);
  return g_algos.size();
}

bool GemmContext::tunes_by_default() const { return impl_->tune_by_default; }

void GemmContext::gemm(const GemmShape& s, const bf16* A, const bf16* B, float* C, float alpha, float beta) {
  run(s, {A, B, nullptr, nullptr}, C, true, alpha, beta);
}
void GemmContext::gemm(const GemmShape& s, const bf16* A, const bf16* B, bf16* C, float alpha, float beta) {
  run(s, {A, B, nullptr, nullptr}, C, false, alpha, beta);
}

namespace {
void check_fp8_shape(const GemmShape& s, const float* a_scale, const float* b_scale) {
  if (!a_scale || !b_scale) throw std::invalid_argument("gemm_fp8: both scale vectors are required");
  if (s.trans_a || !s.trans_b)
    throw std::invalid_argument("gemm_fp8: only y = x @ W^T (trans_a false, trans_b true) runs in FP8");
  if (s.K % 16 != 0)
    throw std::invalid_argument("gemm_fp8: K " + std::to_string(s.K) + " is not a multiple of 16 (cuBLASLt's FP8 rule)");
}
}  // namespace

void GemmContext::gemm_fp8(const GemmShape& s, const fp8* A, const float* a_scale, const fp8* B, const float* b_scale,
                           float* C, float beta) {
  check_fp8_shape(s, a_scale, b_scale);
  run(s, {A, B, a_scale, b_scale}, C, true, 1.f, beta);
}
void GemmContext::gemm_fp8(const GemmShape& s, const fp8* A, const float* a_scale, const fp8* B, const float* b_scale,
                           bf16* C, float beta) {
  check_fp8_shape(s, a_scale, b_scale);
  run(s, {A, B, a_scale, b_scale}, C, false, 1.f, beta);
}

void GemmContext::run(const GemmShape& s, const Operands& ops, void* C, bool c_f32, float alpha, float beta) {
  if (s.M <= 0 || s.N <= 0 || s.K <= 0)
    throw std::invalid_argument("gemm: sizes must be positive (M " + std::to_string(s.M) + ", N " +
                                std::to_string(s.N) + ", K " + std::to_string(s.K) + ")");
  const void *A = ops.A, *B = ops.B;
  const bool fp8 = ops.a_scale != nullptr;
  if (log_) log_->push_back({s, c_f32, beta != 0.f, fp8});
  // Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T: cuBLAS sees
  // "A" = our B (m = N), "B" = our A (n = M).
  const cublasOperation_t opa = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint64_t a_rows = s.trans_b ? s.K : s.N, a_cols = s.trans_b ? s.N : s.K;  // column-major storage of B
  const uint64_t b_rows = s.trans_a ? s.M : s.K, b_cols = s.trans_a ? s.K : s.M;  // column-major storage of A
  const cudaDataType_t ct = c_f32 ? CUDA_R_32F : CUDA_R_16BF;
  const cudaDataType_t abt = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;

  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  auto cleanup = [&] {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  };
  try {
    lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), "set TRANSA");
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), "set TRANSB");
    if (fp8) {  // scale vectors along cuBLAS's rows of "A" (our B's rows: N) and columns of "B" (our A's rows: M)
      const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode)), "A scale mode");
      lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode)), "B scale mode");
      lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ops.b_scale, sizeof(void*)),
               "A scale pointer");
      lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ops.a_scale, sizeof(void*)),
               "B scale pointer");
    }
    lt_check(cublasLtMatrixLayoutCreate(&la, abt, a_rows, a_cols, int64_t(a_rows)), "layout A");
    lt_check(cublasLtMatrixLayoutCreate(&lb, abt, b_rows, b_cols, int64_t(b_rows)), "layout B");
    lt_check(cublasLtMatrixLayoutCreate(&lc, ct, uint64_t(s.N), uint64_t(s.M), s.N), "layout C");

    const GemmTune mode = gemm_tune_mode();
    const bool tune = s.M >= kTuneMinRows && (mode == GemmTune::kOn || mode == GemmTune::kLog ||
                                               (mode == GemmTune::kAuto && impl_->tune_by_default));
    const AlgoKey key{s.M, s.N, s.K, s.trans_a, s.trans_b, c_f32, beta != 0.f, tune, device_kind(), fp8};
    cublasLtMatmulAlgo_t algo{};
    bool found = false;
    {
      std::lock_guard<std::mutex> lk(g_algo_mutex);
      auto it = g_algos.find(key);
      if (it != g_algos.end()) algo = it->second, found = true;
    }
    // cuBLASLt's best-ranked candidates for this shape and these pointers' alignment, up to `want` of
    // them, into h; their number.
    auto heuristic = [&](int want, cublasLtMatmulHeuristicResult_t* h) {
      if (!pref) {
        lt_check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
        lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &impl_->workspace_bytes, sizeof(impl_->workspace_bytes)),
                 "set workspace");
        // cuBLAS's A is our B, its B our A (see above); C is also D.
        for (auto [attr, p] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<const void*>(B)},
                               std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<const void*>(A)},
                               std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<const void*>(C)},
                               std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<const void*>(C)}}) {
          uint32_t align = 256;
          while (align > 1 && reinterpret_cast<uintptr_t>(p) % align != 0) align /= 2;
          lt_check(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)), "set alignment");
        }
      }
      int n = 0;
      lt_check(cublasLtMatmulAlgoGetHeuristic(impl_->handle, op, la, lb, lc, lc, pref, want, h, &n),
               "AlgoGetHeuristic");
      if (n == 0)
        throw std::runtime_error("cuBLASLt: no algorithm for M " + std::to_string(s.M) + " N " + std::to_string(s.N) +
                                 " K " + std::to_string(s.K));
      return n;
    };
    if (!found) {
      // Tuned: a choice already made for this M bucket, where cuBLASLt confirms it fits this M.
      const AlgoKey bucket{m_bucket(s.M), s.N, s.K, s.trans_a, s.trans_b, c_f32, beta != 0.f, true, std::get<8>(key), fp8};
      bool have = false;
      if (tune) {
        std::lock_guard<std::mutex> lk(g_algo_mutex);
        auto it = g_tuned.find(bucket);
        if (it != g_tuned.end()) algo = it->second, have = true;
      }
      if (have) {
        cublasLtMatmulHeuristicResult_t r{};
        have = cublasLtMatmulAlgoCheck(impl_->handle, op, la, lb, lc, lc, &algo, &r) == CUBLAS_STATUS_SUCCESS &&
               r.workspaceSize <= impl_->workspace_bytes;
      }
      if (!have) {
        cublasLtMatmulHeuristicResult_t h[kCandidates]{};
        const int n = heuristic(tune ? kCandidates : 1, h);
        int pick = -1;
        if (n > 1) {
          const size_t c_bytes = size_t(s.M) * size_t(s.N) * (c_f32 ? 4 : 2);
          float ms[kCandidates];
          pick = fastest_candidate(impl_->handle, op, la, lb, lc, h, n, &alpha, &beta, A, B, C, c_bytes,
                                   impl_->workspace, impl_->workspace_bytes, stream_, ms);
          if (mode == GemmTune::kLog && pick >= 0)
            std::fprintf(stderr,
                         "dflash gemm tune: %sM %ld N %ld K %ld trans_a %d trans_b %d %s beta %g: candidate %d of %d, "
                         "%.1f us (heuristic's first %.1f us)\n",
                         fp8 ? "fp8 " : "", long(s.M), long(s.N), long(s.K), int(s.trans_a), int(s.trans_b),
                         c_f32 ? "fp32" : "bf16",
                         double(beta), pick, n, 1e3 * double(ms[pick]), 1e3 * double(ms[0]));
        }
        algo = h[std::max(pick, 0)].algo;
        if (pick >= 0) {
          std::lock_guard<std::mutex> lk(g_algo_mutex);
          g_tuned.emplace(bucket, algo);  // the bucket's first choice stays; this M keeps its own winner
        }
      }
      std::lock_guard<std::mutex> lk(g_algo_mutex);
      algo = g_algos.emplace(key, algo).first->second;
    }
    auto matmul = [&] {
      return cublasLtMatmul(impl_->handle, op, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &algo, impl_->workspace,
                            impl_->workspace_bytes, stream_);
    };
    cublasStatus_t st = matmul();
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
      // A choice made for other pointers (a shape's first call; or a bucket's tuned choice, which
      // AlgoCheck confirmed for this M without seeing the pointers) that these pointers' alignment
      // does not support: cuBLASLt's first choice for this alignment from now on.
      cublasLtMatmulHeuristicResult_t h{};
      heuristic(1, &h);
      algo = h.algo;
      {
        std::lock_guard<std::mutex> lk(g_algo_mutex);
        g_algos[key] = algo;
      }
      st = matmul();
    }
    lt_check(st, "Matmul");
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
}

}  // namespace dflash::cuda
