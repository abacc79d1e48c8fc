// Cross entropy against a frozen LM head on the GPU, forward and backward fused, in row chunks: the
// [rows, V] logits never exist at once, and nothing is computed twice. Per chunk of rows: fp32
// logits by one cuBLASLt GEMM, one kernel for the per-row softmax statistics and the logit gradient,
// one GEMM for d h. Reference: src/ops/cpu/chunked_ce.cpp (chunked_cross_entropy).
#pragma once
#include <cstdint>
#include <vector>

#include "ops/cuda/gemm.h"

namespace dflash::cuda {

/// Per-row results (device arrays of `rows` elements).
struct CeRowStats {
  float* lse = nullptr;           // logsumexp over the vocabulary (natural log)
  float* target_logit = nullptr;  // logit of the row's target
  int32_t* argmax = nullptr;      // index of the largest logit (first one on ties)
};

/// Row chunk for `rows` rows (> 0) that keeps one chunk's fp32 logits within `max_bytes` (or at 16
/// rows): `rows` itself when they fit, else the fewest chunks, of equal size rounded up to a multiple of
/// 128 rows (whole GEMM tiles; the last chunk takes the rest) where that still fits, else of 16.
/// Throws std::invalid_argument for V <= 0 or rows <= 0.
int64_t cross_entropy_row_chunk(int64_t V, int64_t rows, int64_t max_bytes = int64_t(1) << 30);
/// Workspace (bytes) for `row_chunk` rows: fp32 logits, plus (with_dh: cross_entropy given dh) the
/// bf16 logit gradient.
int64_t cross_entropy_workspace_bytes(int64_t row_chunk, int64_t V, bool with_dh);

/// logits = h [rows, d] @ W [V, d]^T, rows processed `row_chunk` at a time, in `workspace`
/// (cross_entropy_workspace_bytes(row_chunk, V, dh != nullptr)). Fills `stats`. When dh
/// is non-null also the backward of loss = sum_r coef_r * CE_r (coef [rows] fp32 on the device, e.g.
/// w_r / sum(w)): dh [rows, d] (bf16, overwritten) = (coef_r * (softmax_r - onehot(target_r))) @ W,
/// the logit gradient rounded to bf16 before the product. targets [rows] int32, each in [0, V).
/// Throws std::invalid_argument for bad sizes.
void cross_entropy(GemmContext& gemm, const bf16* h, const bf16* W, int64_t rows, int64_t d, int64_t V,
                   const int32_t* targets, const float* coef, int64_t row_chunk, void* workspace, CeRowStats stats,
                   bf16* dh);

/// The most likely token of each row: argmax_v (h [rows, d] @ W [V, d]^T)[r, v] (first on ties), from
/// the cross entropy's row statistics (the [rows, V] logits never exist at once). Runs on
/// gemm.stream() and synchronizes it (the result is copied to the host).
std::vector<int32_t> lm_head_argmax(GemmContext& gemm, const bf16* h, const bf16* W, int64_t rows, int64_t d,
                                    int64_t V);

}  // namespace dflash::cuda
