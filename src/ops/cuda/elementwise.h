// Element-wise GPU ops of the dense path: SwiGLU forward / backward, embedding gather, residual add
// (references: src/ops/cpu/activation.cpp swiglu / swiglu_backward; transformers' SiLU * up).
#pragma once
#include <cstdint>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// act [rows, n] = silu(gate) * up with gate = gate_up[:, :n], up = gate_up[:, n:] (gate_up [rows, 2n]:
/// one GEMM of the concatenated gate_proj | up_proj weights), bf16 in and out, fp32 math. act must not
/// overlap gate_up. Throws std::invalid_argument on negative sizes.
void swiglu_forward(const bf16* gate_up, int64_t rows, int64_t n, bf16* act, cudaStream_t stream);

/// Backward of swiglu_forward, in place: gate_up [rows, 2n] (gate | up) becomes dgate | dup, with
/// s = sigmoid(g): dgate = dact * up * s * (1 + g * (1 - s)), dup = dact * g * s; dact [rows, n].
/// Throws std::invalid_argument on negative sizes.
void swiglu_backward(bf16* gate_up, const bf16* dact, int64_t rows, int64_t n, cudaStream_t stream);

/// out [rows, d] = table[ids[r], :] (table [V, d] bf16). An id outside [0, V) writes NaN rows and
/// sets *bad_id (device int, if non-null) to 1, so the caller can report it without a crash.
void embedding_gather(const bf16* table, int64_t V, int64_t d, const int32_t* ids, int64_t rows, bf16* out,
                      int* bad_id, cudaStream_t stream);

/// out[ids[r], :] = rows[r, :] for r < n (rows [n, d] bf16, out [N, d]; ids distinct, in [0, N): checked
/// by the caller). Other rows of out are left as they are. The inverse of embedding_gather.
void scatter_rows(const bf16* rows, int64_t n, int64_t d, const int32_t* ids, bf16* out, cudaStream_t stream);

/// Sets *flag (device int) to 1 when any of x [n] (bf16) is NaN or Inf; leaves it alone otherwise
/// (the caller zeroes it). For the training taps: bad numbers are named before they reach a loss.
void flag_nonfinite(const bf16* x, int64_t n, int* flag, cudaStream_t stream);

/// y [n] += x [n] (bf16, fp32 add, rounded once).
void add_inplace(bf16* y, const bf16* x, int64_t n, cudaStream_t stream);

/// y [n] *= sigmoid(gate [n]) (bf16, fp32 math, rounded once): the output gate of Qwen3.5 attention.
void mul_sigmoid(bf16* y, const bf16* gate, int64_t n, cudaStream_t stream);

/// x[i] = mean + std * z_i, z_i standard normal from a counter-based hash of (seed, i) (Box-Muller
/// over splitmix64): the same values for the same seed on every GPU and launch shape. For random
/// benchmark weights and inputs, never for training data.
void fill_normal(float* x, int64_t n, uint64_t seed, float mean, float std, cudaStream_t stream);
void fill_normal(bf16* x, int64_t n, uint64_t seed, float mean, float std, cudaStream_t stream);

}  // namespace dflash::cuda
