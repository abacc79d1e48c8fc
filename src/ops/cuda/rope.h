// Rotary position embedding on the GPU (reference: src/ops/cpu/rope.cpp apply_rope; transformers'
// apply_rotary_pos_emb with rotate_half, partial rotary as Qwen3.5).
#pragma once
#include <cstdint>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// cos / sin tables [n, rot/2] fp32 for positions pos [n]: angle = pos * inv_freq[i], i < rot/2,
/// computed in double, times `scale` (yarn's attention factor, cpu::rope_attention_factor) and rounded
/// once. inv_freq [rot/2] (device, double) is chosen by the caller: transformers' float32 values
/// (cpu::rope_inv_freq) for targets, exact ones (cpu::rope_frequencies<double>) for the drafter.
void rope_table(const int64_t* pos, const double* inv_freq, int64_t n, int64_t rot, float* cos, float* sin,
                cudaStream_t stream, double scale = 1.0);

/// In place on x [n, H, D] bf16: for token t and head h rotates dims [0, rot) pairing i with i + rot/2:
///   a' = a cos - b sin,  b' = b cos + a sin  (inverse: sin -> -sin, the backward of the rotation);
/// dims >= rot pass. rot even, rot <= D.
void rope_apply(bf16* x, int64_t n, int64_t H, int64_t D, int64_t rot, const float* cos, const float* sin,
                bool inverse, cudaStream_t stream);

}  // namespace dflash::cuda
