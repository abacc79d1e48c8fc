#include <cublasLt.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "ops/cuda/gemm.h"

namespace dflash::cuda {

namespace {

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt: ") + what + " failed with status " + std::to_string(int(s)));
}

// (M, N, K, trans_a, trans_b, out f32, beta != 0, device)
using AlgoKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, bool, bool, int>;
std::mutex g_algo_mutex;
std::map<AlgoKey, cublasLtMatmulAlgo_t> g_algos;

}  // namespace

struct GemmContext::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

GemmContext::GemmContext(cudaStream_t stream, size_t workspace_bytes) : impl_(new Impl), stream_(stream) {
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

void GemmContext::gemm(const GemmShape& s, const bf16* A, const bf16* B, float* C, float alpha, float beta) {
  run(s, A, B, C, true, alpha, beta);
}
void GemmContext::gemm(const GemmShape& s, const bf16* A, const bf16* B, bf16* C, float alpha, float beta) {
  run(s, A, B, C, false, alpha, beta);
}

void GemmContext::run(const GemmShape& s, const bf16* A, const bf16* B, void* C, bool c_f32, float alpha,
                      float beta) {
  if (s.M <= 0 || s.N <= 0 || s.K <= 0)
    throw std::invalid_argument("gemm: sizes must be positive (M " + std::to_string(s.M) + ", N " +
                                std::to_string(s.N) + ", K " + std::to_string(s.K) + ")");
  // Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T: cuBLAS sees
  // "A" = our B (m = N), "B" = our A (n = M).
  const cublasOperation_t opa = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint64_t a_rows = s.trans_b ? s.K : s.N, a_cols = s.trans_b ? s.N : s.K;  // column-major storage of B
  const uint64_t b_rows = s.trans_a ? s.M : s.K, b_cols = s.trans_a ? s.K : s.M;  // column-major storage of A
  const cudaDataType_t ct = c_f32 ? CUDA_R_32F : CUDA_R_16BF;

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
    lt_check(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, a_rows, a_cols, int64_t(a_rows)), "layout A");
    lt_check(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, b_rows, b_cols, int64_t(b_rows)), "layout B");
    lt_check(cublasLtMatrixLayoutCreate(&lc, ct, uint64_t(s.N), uint64_t(s.M), s.N), "layout C");

    int device = 0;
    DFLASH_CUDA_CHECK(cudaGetDevice(&device));
    const AlgoKey key{s.M, s.N, s.K, s.trans_a, s.trans_b, c_f32, beta != 0.f, device};
    cublasLtMatmulAlgo_t algo;
    bool found = false;
    {
      std::lock_guard<std::mutex> lk(g_algo_mutex);
      auto it = g_algos.find(key);
      if (it != g_algos.end()) algo = it->second, found = true;
    }
    if (!found) {
      lt_check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
      lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &impl_->workspace_bytes, sizeof(impl_->workspace_bytes)),
               "set workspace");
      cublasLtMatmulHeuristicResult_t h{};
      int n = 0;
      lt_check(cublasLtMatmulAlgoGetHeuristic(impl_->handle, op, la, lb, lc, lc, pref, 1, &h, &n), "AlgoGetHeuristic");
      if (n == 0)
        throw std::runtime_error("cuBLASLt: no algorithm for M " + std::to_string(s.M) + " N " + std::to_string(s.N) +
                                 " K " + std::to_string(s.K));
      algo = h.algo;
      std::lock_guard<std::mutex> lk(g_algo_mutex);
      g_algos.emplace(key, algo);
    }
    lt_check(cublasLtMatmul(impl_->handle, op, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &algo, impl_->workspace,
                            impl_->workspace_bytes, stream_),
             "Matmul");
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
}

}  // namespace dflash::cuda
