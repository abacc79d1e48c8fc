// DSpark's loss on the GPU, per chunk of rows, over fp32 logits the caller's GEMMs produced: the row
// statistics and logit gradient of 0.1 CE + 0.9 L1 + BCE(confidence), and the confidence head's
// backward with the Markov embedding's scatter. Reference: dspark_loss (src/models/dspark.cpp).
#pragma once
#include <cstdint>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// Per-row results of dspark_rows (device arrays of `rows` elements).
struct DSparkRowStats {
  float* ce = nullptr;       // logsumexp(z) - z[label]
  float* l1 = nullptr;       // || softmax(z) - softmax(t) ||_1
  float* bce = nullptr;      // BCE with logits of the confidence c against y = clamp(1 - l1 / 2, 0, 1)
  int32_t* argmax = nullptr; // argmax of z (first on ties)
  float* dc = nullptr;       // coef * (sigmoid(c) - y): d loss / d c
};

/// For each row r (one block each): z [rows, V] the corrected draft logits (lm_head h + W2 e), t [rows, V]
/// the target's logits, labels [rows], coef [rows] (w / sum w; 0 skips the row's gradient), h [rows, d]
/// and e [rows, rk] (bf16) the confidence head's input [h ; e], cw [d + rk] and cb [1] (fp32) its
/// weights. Fills `st`; when dz is non-null also dz [rows, V] (bf16) = coef (0.1 (p - onehot(label)) +
/// 0.9 p (s - s.p)), p = softmax(z), s = sign(p - softmax(t)). Throws std::invalid_argument on sizes.
void dspark_rows(const float* z, const float* t, int64_t rows, int64_t V, const int32_t* labels, const float* coef,
                 const bf16* h, const bf16* e, int64_t d, int64_t rk, const float* cw, const float* cb, DSparkRowStats st,
                 bf16* dz, cudaStream_t stream);

/// The confidence head's backward and the Markov embedding's, per row: dh [rows, d] (bf16) =
/// dh_lm [rows, d] (fp32, lm_head^T dz) + dc cw[:d]; de = de_lm [rows, rk] (fp32, W2^T dz) + dc cw[d:],
/// added to dW1 [V, rk] at row prev[r] (fp32 atomics); dcw [d + rk] += dc [h ; e], dcb [1] += dc.
void dspark_heads_backward(const float* dc, const bf16* h, const bf16* e, const int32_t* prev, int64_t rows, int64_t d,
                           int64_t rk, const float* cw, const float* dh_lm, const float* de_lm, bf16* dh, float* dW1,
                           float* dcw, float* dcb, cudaStream_t stream);

}  // namespace dflash::cuda
