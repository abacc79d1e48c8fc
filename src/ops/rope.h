// Rotary position embedding (transformers modeling_rope_utils.py + apply_rotary_pos_emb).
#pragma once
#include <cstdint>
#include <vector>

#include "ops/rope_spec.h"
#include "tensor/tensor.h"

namespace dflash::cpu {

/// Inverse frequencies [rotary_dim / 2] for `rope` over rotary_dim dims: theta^(-2i / rotary_dim),
/// rescaled for rope.type "llama3" (transformers _compute_llama3_parameters) or "yarn"
/// (_compute_yarn_parameters: a ramp between interpolated and extrapolated frequencies); other
/// types throw std::invalid_argument. T = float: the powers in fp32 as torch computes them (targets,
/// checked against transformers); double: exact (the drafter's reference). Scaling arithmetic is double.
template <typename T>
std::vector<T> rope_frequencies(const RopeSpec& rope, int64_t rotary_dim);
/// rope_frequencies<float>: a target's frequencies.
std::vector<float> rope_inv_freq(const RopeSpec& rope, int64_t rotary_dim);
/// The factor transformers multiplies cos and sin by (its attention_scaling): for yarn the given
/// attention_factor, else 0.1 ln(factor) + 1 (with mscale / mscale_all_dim: their ratio of that
/// form); 1 for the other types.
double rope_attention_factor(const RopeSpec& rope);

/// In place on x [T, H, Dh]: for each token t rotates dims [0, rotary_dim) with the rotate_half
/// pairing (dim i with i + rotary_dim/2) by angle positions[t] * inv_freq; dims >= rotary_dim pass
/// (partial rotary). T = float (angle as torch's fp32 product) or double (angle in double).
/// The rotation saves nothing: it is linear and orthogonal.
template <typename T>
void apply_rope(BasicTensor<T>& x, const std::vector<int64_t>& positions, const std::vector<float>& inv_freq,
                int64_t rotary_dim);

/// Backward of apply_rope, in place on dy [T, H, Dh] (becomes dx): the transpose of a rotation is the
/// rotation by the negative angle; pass-through dims pass through.
template <typename T>
void apply_rope_backward(BasicTensor<T>& dy, const std::vector<int64_t>& positions,
                         const std::vector<float>& inv_freq, int64_t rotary_dim);

}  // namespace dflash::cpu
