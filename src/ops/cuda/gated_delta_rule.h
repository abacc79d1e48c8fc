// GatedDeltaNet on the GPU (Qwen3.5 / 3.6 linear-attention layers; transformers
// models/qwen3_5/modeling_qwen3_5.py, flash-linear-attention fla/ops/gated_delta_rule): the causal
// depthwise conv1d + SiLU, the per-token inputs of the recurrence, the chunked gated delta rule
// forward and the gated RMSNorm. References: src/ops/cpu/gated_delta_rule.cpp (causal_conv1d_silu,
// gated_delta_rule_recurrent) and src/ops/cpu/norm.cpp (gated_rms_norm, l2_norm).
// The input projections (in_proj_qkv | in_proj_z | in_proj_b | in_proj_a, one GEMM) are bf16, as
// transformers rounds each projection's output; the activations after them (conv1d, q / k / v, o)
// fp32; out_proj's input bf16; recurrent state and gates fp32. Every function runs on `stream`, holds no state
// and may be called from many threads and streams at once.
#pragma once
#include <cstdint>
#include <vector>

#include "gpu/runtime.h"

namespace dflash::cuda {

/// First row of each row's sequence, [T] int32, from cu_seqlens [n + 1] (host): what the conv1d's
/// per-sequence zero padding needs.
std::vector<int32_t> sequence_starts(const std::vector<int64_t>& cu_seqlens);

/// gdn_prepare's query / key step, done by causal_conv1d_silu on its output when given: channels
/// [0, Hk dk) are Hk query heads of dk, [Hk dk, 2 Hk dk) the key heads; each head's row becomes
/// l2norm(x) (times q_scale for the queries) in q / k [T, Hk, dk] fp32 (as gdn_prepare writes them);
/// y's first 2 Hk dk columns are then undefined (the fused path leaves them unwritten).
struct ConvQkNorm {
  int Hk = 0, dk = 0;
  float q_scale = 1.f;
  float* q = nullptr;
  float* k = nullptr;
};

/// Causal depthwise conv1d + SiLU over packed sequences, zero left padding per sequence:
/// y[t, c] = silu(sum_{j<K} w[c, j] * x[t - K + 1 + j, c]) where rows before row_start[t] count as
/// zero, in fp32. x: the first C columns of [T, x_stride] bf16 (in_proj's output, read in place),
/// w [C, K] fp32 (K <= 8), row_start [T] int32 (device) -> y [T, C] fp32. With qk (2 Hk dk <= C) the
/// queries and keys are normalized in the same kernel where a head is an aligned group of 1..32 lanes
/// of four channels (dk a power of two, 4..128; C and x_stride multiples of 4, x 8-byte, y, q, k
/// 16-byte aligned), else by a second one. Throws std::invalid_argument for K outside 1..8, x_stride < C or
/// bad qk sizes.
void causal_conv1d_silu(const bf16* x, int64_t x_stride, const float* w, const int32_t* row_start, int64_t T,
                        int64_t C, int K, float* y, cudaStream_t stream, const ConvQkNorm* qk = nullptr);

/// The recurrence's inputs from a GatedDeltaNet layer's projections, per row t:
///   q = scale * l2norm(qkv[t, q part]), k = l2norm(qkv[t, k part])   [T, Hk, dk] fp32
///   v = qkv[t, v part]                                               [T, Hv, dv] fp32
///   beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)       [T, Hv] fp32
/// qkv [T, 2*Hk*dk + Hv*dv] fp32 (q | k | v, the conv1d output); b and a bf16, token t's Hv values at
/// b + t ba_stride and a + t ba_stride (in_proj's output, read in place; ba_stride >= Hv); A_log and
/// dt_bias [Hv] fp32. l2norm(x) = x / sqrt(sum x^2 + 1e-6) in fp32. dk <= 256. v may be null (not
/// written): gated_delta_rule_chunked reads the values in place from qkv with v_row_stride; q and k
/// may be null together (not written: causal_conv1d_silu made them, ConvQkNorm).
/// Throws std::invalid_argument for bad head counts or dims.
void gdn_prepare(const float* qkv, const bf16* b, const bf16* a, int64_t ba_stride, const float* A_log,
                 const float* dt_bias, int64_t T, int Hk, int Hv, int dk, int dv, float scale, float* q, float* k,
                 float* v, float* g, float* beta, cudaStream_t stream);

/// One chunk of gated_delta_rule_chunked: first row, length (<= 64) and sequence.
struct GdnChunk {
  int32_t start, len, seq;
};

/// The chunks of a packed batch (cu_seqlens, host [n + 1]) on the device, made once per batch and
/// shared by every GatedDeltaNet layer of a forward (no host-to-device copy per layer). Lives on
/// `stream` (stream-ordered memory). Throws std::invalid_argument for bad cu_seqlens or more rows
/// than int32 indexing allows.
struct GdnChunkPlan {
  GdnChunkPlan(const std::vector<int64_t>& cu_seqlens, cudaStream_t stream);
  int nseq = 0;
  int64_t T = 0, count = 0;
  StreamBuffer<GdnChunk> chunks;  // [count]
  StreamBuffer<int32_t> first;    // [nseq + 1]: sequence s owns chunks first[s] .. first[s + 1] - 1
};

/// The gated RMSNorm (as gated_rms_norm, n = dv) gated_delta_rule_chunked can apply to its output
/// rows before they leave the kernel: y [T, Hv, dv] bf16 instead of o. z bf16, token t's Hv x dv
/// values at z + t z_stride (z_stride >= Hv dv); w [dv] fp32; y 4-byte aligned (bf16 pairs).
struct GatedNormOut {
  const bf16* z = nullptr;
  int64_t z_stride = 0;
  const float* w = nullptr;
  float eps = 0.f;
  bf16* y = nullptr;
};

/// A GatedDeltaNet layer's inputs to gated_delta_rule_chunked straight from its input projections
/// (no cache): the conv1d + SiLU (as causal_conv1d_silu), the q / k l2norm (ConvQkNorm) and the gates
/// (as gdn_prepare) are then computed by the chunked rule's first kernel, chunk by chunk, and q, k, v,
/// g, beta are not read (they may be null). x: [T, x_stride] bf16, channels q | k | v (2 Hk dk + Hv dv)
/// first; conv_w [C, K] fp32; b, a: token t's Hv values at b + t ba_stride (bf16); A_log, dt_bias [Hv]
/// fp32; q_scale multiplies the normalized queries. Each sequence's conv starts from zeros (its first
/// chunk sees no earlier rows).
struct GdnProjections {
  const bf16* x = nullptr;
  int64_t x_stride = 0;
  const float* conv_w = nullptr;
  int K = 0;
  const bf16* b = nullptr;
  const bf16* a = nullptr;
  int64_t ba_stride = 0;
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  float q_scale = 1.f;
  const int32_t* row_start = nullptr;  // [T] sequence_starts(cu_seqlens) (device; read where the kernels run apart)
};

/// Whether `p` lets gated_delta_rule_chunked compute its conv1d, l2norm and gates inside its chunk
/// preparation at key dim dk (conv kernel 4, dk a power of two, x 8-byte aligned, x_stride a
/// multiple of 4) rather than by causal_conv1d_silu and gdn_prepare first. The chunked rule fuses
/// them only with the tensor-core chunk_state as well, which the GPU's shared memory decides (not
/// checked here).
bool gdn_projections_fuse(const GdnProjections& p, int dk);

/// Gated delta rule forward over packed sequences (cu_seqlens, host [n + 1]), in chunks of 64 tokens
/// (the WY / UT form of flash-linear-attention's chunk_gated_delta_rule; fp32 values and state, the
/// matrix products in 3xBF16 on tensor cores: the output is ~7e-6 (relative L2) from the fp32
/// recurrence's at the Qwen3.6 head shapes, as `bench gdn` records). q (already normalized and scaled), k [T, Hk, dk] fp32; v [T, Hv, dv] fp32; g
/// (log decay) and beta [T, Hv] fp32; value head h reads key head h / (Hv / Hk). Per sequence and
/// value head, token by token as cpu::gated_delta_rule_recurrent with use_qk_l2norm false, scale 1:
///   S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t.
/// initial_state (null: zeros) and final_state (null: not written) [n, Hv, dk, dv] fp32 (device).
/// Writes o [T, Hv, dv] fp32. dk, dv multiples of 4, <= 128. Throws std::invalid_argument for bad sizes.
void gated_delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                              const std::vector<int64_t>& cu_seqlens, int Hk, int Hv, int dk, int dv,
                              const float* initial_state, float* final_state, float* o, cudaStream_t stream);
/// The same over the chunks of `plan` (its stream is the one to pass). shared_limit (bytes, 0: the
/// device's opt-in limit) caps the shared memory per block the kernels may use: below what the
/// tensor-core chunk_state needs (at dk 128 ~209 KB with 64 state columns per block, ~212 KB on
/// Hopper's warpgroup MMAs, ~177 KB with 32; A100 offers 163 KB) its SIMT form runs
/// (gdn_chunk_state_kernel says which one runs). Throws
/// std::runtime_error when even that does not fit. v_row_stride (floats, 0: Hv dv): token t's values
/// at v + t v_row_stride, e.g. the v part of the conv1d output read in place (a multiple of 4, v
/// 16-byte aligned; std::invalid_argument otherwise). With `norm` the output rows go through its
/// gated RMSNorm to norm->y and o is not written (it may be null): the layer's o never goes to memory.
/// With `from` the inputs come from the projections (GdnProjections; v_row_stride is then ignored):
/// in one kernel with the chunk preparation where gdn_projections_fuse and the tensor-core
/// chunk_state runs, else by causal_conv1d_silu and gdn_prepare first (std::invalid_argument as those
/// throw); std::invalid_argument when x, conv_w, b, a, A_log, dt_bias or row_start is null, x_stride
/// < 2 Hk dk + Hv dv or ba_stride < Hv. Also std::invalid_argument when chunks x Hv exceed INT32_MAX.
/// On sm_90+ the kernels overlap (programmatic dependent launch: the tensor-core chunk_state beside
/// chunk_prepare, chunk_out beside chunk_state) and chunk_out may finish before chunk_state has written
/// final_state: a kernel launched after this one with programmatic dependent launch must not read
/// final_state before its own griddepcontrol.wait (a plain launch waits for all three).
void gated_delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                              const GdnChunkPlan& plan, int Hk, int Hv, int dk, int dv, const float* initial_state,
                              float* final_state, float* o, cudaStream_t stream, size_t shared_limit = 0,
                              int64_t v_row_stride = 0, const GatedNormOut* norm = nullptr,
                              const GdnProjections* from = nullptr);

/// The most one gated_delta_rule_chunked call over T tokens in nseq sequences holds in temporaries
/// (bytes), whichever kernels it picks (the projections apart or inside, tensor-core or SIMT chunk_state).
int64_t gated_delta_rule_chunked_workspace_bytes(int64_t T, int64_t nseq, int Hk, int Hv, int dk, int dv);

/// The chunk_state kernel of gated_delta_rule_chunked: warpgroup MMAs (Hopper, sm_90a code; 64 state
/// columns per block at padded key dim 128), mma.sync with 64 or 32 state columns per block, or fp32
/// SIMT (GPUs with too little shared memory per block for the others, e.g. A100 at dk 128).
enum class GdnChunkState { kWgmma, kMma64, kMma32, kSimt };
/// The chunk_state gated_delta_rule_chunked runs on the current device for nseq sequences of Hv value
/// heads and head dims dk, dv (shared_limit as there). Throws std::runtime_error on CUDA errors.
GdnChunkState gdn_chunk_state_kernel(int nseq, int Hv, int dk, int dv, size_t shared_limit = 0);

// ---- Decoding and speculative verification (src/ops/cuda/gated_delta_decode.cu) ----
// Per sequence s of a cached batch: window [n_seq, K-1, C] holds the last K-1 conv inputs before the
// new tokens (zeros at the start), state [n_seq, Hv, dk, dv] the recurrent state; cu_seqlens gives
// each sequence's new tokens (it may have none).

/// causal_conv1d_silu continuing cached windows: rows before a sequence's first new token come from
/// its window (window[s][K-2-j] is the input j + 1 rows back). x: the first C columns of [T, x_stride]
/// bf16; window fp32; w [C, K], seq_of [T] and cu [n_seq + 1] int32 (device) -> y [T, C] fp32.
/// K <= 8, x_stride >= C (std::invalid_argument).
void causal_conv1d_silu_window(const bf16* x, int64_t x_stride, const float* w, const float* window,
                               const int32_t* seq_of, const int32_t* cu, int64_t T, int64_t C, int K, float* y,
                               cudaStream_t stream);

/// After a cached forward: hist [n_seq * (K-1) + T, C] fp32 = per sequence s, from row s * (K-1) +
/// cu[s], its old window then its new conv inputs (x as in causal_conv1d_silu_window; the CPU
/// TargetCache's window_hist); then each window becomes the last K-1 rows of its history. window and
/// hist must not overlap.
void conv_window_advance(float* window, const bf16* x, int64_t x_stride, const int32_t* cu, int n_seq, int64_t T,
                         int64_t C, int K, float* hist, cudaStream_t stream);

/// The gated delta rule token by token (as cpu::gated_delta_rule_recurrent, for q / k already
/// normalized and scaled by gdn_prepare): per sequence s and token, S = exp(g) S; u = beta (v - S^T k);
/// S += k u^T; o = S^T q. state [n_seq, Hv, dk, dv] is read and updated in place; token_states (when
/// given) [T, Hv, dk, dv] gets the state after every token. With `counts` (one per sequence) only the
/// first counts[s] tokens of sequence s run (a rollback's replay of an accepted prefix). dk <= 128,
/// dv <= 128, 0 <= counts[s] <= its length (std::invalid_argument). For the few tokens of a decoding /
/// verification step.
void gated_delta_rule_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                const std::vector<int64_t>& cu_seqlens, int Hk, int Hv, int dk, int dv, float* state,
                                float* token_states, float* o, cudaStream_t stream,
                                const std::vector<int64_t>& counts = {});

/// Gated RMSNorm (Qwen3_5RMSNormGated): per row of n, y = w * (x * rsqrt(mean(x^2) + eps)) * silu(z),
/// in fp32. x [rows, n] fp32 with row r = (token r / heads, head r % heads); z bf16 (in_proj_z's
/// output, read in place from in_proj's), row r at z + (r / heads) z_stride + (r % heads) n
/// (z_stride >= heads n); w [n] fp32 -> y [rows, n] bf16 (out_proj's GEMM input). Throws
/// std::invalid_argument for bad sizes.
void gated_rms_norm(const float* x, const bf16* z, int64_t heads, int64_t z_stride, const float* w, bf16* y,
                    int64_t rows, int64_t n, double eps, cudaStream_t stream);

}  // namespace dflash::cuda
