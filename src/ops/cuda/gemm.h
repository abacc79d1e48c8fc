// Matrix products on the GPU through cuBLASLt: bf16 inputs, fp32 accumulation, fp32 or bf16 output.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// Row-major product, PyTorch shape order:
///   C [M, N] = alpha * op(A) @ op(B) + beta * C
/// A is stored [M, K] (trans_a = false) or [K, M] (trans_a = true); B is stored [K, N] or, with
/// trans_b, [N, K]. So y = x @ W^T (nn.Linear, W [N, K]) is {A = x, B = W, trans_b = true};
/// dx = dy @ W is {A = dy, B = W}; dW += dy^T @ x is {A = dy, trans_a = true, B = x, beta = 1}.
/// All matrices contiguous (leading dimension = row length).
struct GemmShape {
  int64_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
};

/// One product as a GemmContext ran it: shape, output type and whether it added to C (beta != 0).
/// What benchmarks record of a step to time its products alone (bench_util: sustained_gemms).
struct GemmCall {
  GemmShape shape;
  bool c_is_f32 = false, accumulate = false;
  bool fp8 = false;  // E4M3 operands with per-row scales (GemmContext::gemm_fp8)
};

/// How GemmContext chooses a shape's cuBLASLt algorithm, from env DFLASH_GEMM_TUNE:
///   unset / empty (kAuto): tuned in the contexts created with tune_by_default (the target forward's),
///     cuBLASLt's first choice elsewhere (the drafter's training step);
///   "1" (kOn): tuned everywhere; "log" (kLog): the same, printing each choice and its time to stderr;
///   "0" (kOff): cuBLASLt's first heuristic candidate everywhere (what PyTorch runs).
/// Tuned (products of at least 512 rows M; smaller ones always take cuBLASLt's first candidate):
/// the first call of a shape times cuBLASLt's top 8 heuristic candidates on its operands (4 rounds,
/// the first a warm-up; the stream is synchronized) and keeps the fastest for every M (rows) in the
/// same power-of-two bucket, so that a packed forward's changing token count is tuned once per bucket
/// (a choice cuBLASLt's AlgoCheck or the product itself refuses for some M falls back to its first
/// candidate there; so does a shape whose timing fails, e.g. for want of memory for a copy of C).
/// Candidates are asked for the operands' actual alignment; a choice made for other pointers that
/// these refuse (NOT_SUPPORTED, e.g. 2-byte aligned rows) is replaced by the first candidate for them.
/// Measured on an H200 at its 700 W cap (the report of commit f55bcba (git history of bench/results)): the 27B target
/// forward +5.6 %, the 27B drafter step -2.6 % (timed alone, at full clock, the tuned algorithms win
/// there too). Tuned choices can differ between processes (timing noise), and so can the last bits of
/// their products; within one process every GPU of a kind shares them. kOff is bitwise reproducible across processes.
enum class GemmTune { kAuto, kOff, kOn, kLog };
/// The mode DFLASH_GEMM_TUNE names; std::invalid_argument for any other value than those above.
GemmTune gemm_tune_mode();

/// A cuBLASLt handle plus its workspace, bound to one stream. One per thread / stream; the
/// algorithm choice (see GemmTune) is made once per shape, output type, beta == 0 or not, tuned or
/// not and kind of GPU (compute capability and SM count), in a process-wide table guarded by a mutex.
class GemmContext {
 public:
  /// tune_by_default: whether this context tunes under GemmTune::kAuto. Throws std::runtime_error
  /// when cuBLASLt cannot be initialized.
  explicit GemmContext(cudaStream_t stream, size_t workspace_bytes = size_t(32) << 20, bool tune_by_default = false);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  cudaStream_t stream() const { return stream_; }
  /// Whether this context tunes its products under GemmTune::kAuto (the constructor's flag).
  bool tunes_by_default() const;

  /// While `log` is non-null, every product this context runs is also appended to *log (not owned;
  /// benchmarks: which products a step or a forward makes). nullptr stops recording.
  void record_calls(std::vector<GemmCall>* log) { log_ = log; }

  /// C fp32. Throws std::invalid_argument for non-positive sizes, std::runtime_error when cuBLASLt
  /// finds no algorithm or fails.
  void gemm(const GemmShape& s, const bf16* A, const bf16* B, float* C, float alpha = 1.f, float beta = 0.f);
  /// C bf16 (fp32 accumulation, rounded once at the end).
  void gemm(const GemmShape& s, const bf16* A, const bf16* B, bf16* C, float alpha = 1.f, float beta = 0.f);

  /// FP8 product with per-row scales (the target's linears under --target-dtype fp8):
  ///   C [M, N] = beta * C + a_scale[m] * b_scale[n] * sum_k A[m, k] B[n, k]
  /// A [M, K] (activations, a scale per row: per token), B [N, K] (an nn.Linear weight, a scale per
  /// output channel), both E4M3 (ops/cuda/fp8.h quantize_rows_fp8), scales fp32 on the device; fp32
  /// accumulation (cuBLASLt's outer-vector scaling, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F). The
  /// shape must be {M, N, K, false, true} with K a multiple of 16 (std::invalid_argument otherwise);
  /// std::runtime_error when cuBLASLt has no such product on this GPU (fp8_unsupported_reason tells
  /// before). Algorithms are chosen and tuned as for gemm().
  void gemm_fp8(const GemmShape& s, const fp8* A, const float* a_scale, const fp8* B, const float* b_scale, float* C,
                float beta = 0.f);
  void gemm_fp8(const GemmShape& s, const fp8* A, const float* a_scale, const fp8* B, const float* b_scale, bf16* C,
                float beta = 0.f);

  /// The cuBLASLt version and the number of shapes in the algorithm cache (for `dflash inspect`).
  static size_t cached_algorithms();

 private:
  /// Operands of one product: bf16 A, B (scales null) or E4M3 with per-row scales.
  struct Operands {
    const void *A, *B;
    const float *a_scale, *b_scale;
  };
  void run(const GemmShape& s, const Operands& ops, void* C, bool c_is_f32, float alpha, float beta);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  cudaStream_t stream_;
  std::vector<GemmCall>* log_ = nullptr;
};

}  // namespace dflash::cuda
