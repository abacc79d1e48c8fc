// DFlash drafter training step on the GPU. Mirrors drafter_step (src/models/drafter.cpp) op by op: a
// StepWorkspace (the block layout on the device), then per draft layer layer_forward, the loss, and
// per layer layer_backward. Comments give shapes in PyTorch order (Q = num_blocks * B query rows, S
// context rows).
#include "models/cuda/drafter_gpu.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpu/stage_timer.h"
#include "models/cuda/drafter_gpu_impl.h"
#include "models/dspark.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/masked_attention.h"
#include "ops/cuda/norm.h"
#include "ops/cuda/rope.h"
#include "ops/dflash_attention.h"

namespace dflash {

using cuda::bf16;
using cuda::StreamBuffer;
using cuda::upload;

namespace {

using cuda::StageTimer;

/// Saved activations of one draft layer (what the backward needs, as the CPU LayerSaved).
/// In the last layer with compacted rows, x_mid .. act and o_rows hold only the rows with a loss weight.
struct Saved {
  StreamBuffer<bf16> x_in, kv_in, q_pre, q_rot, k_pre, k_rot, v, o, o_rows, x_mid, hp, gu, act;  // gu: gate | up
  StreamBuffer<float> inv_in, q_inv, k_inv, lse, inv_post;
};

/// Elements of one draft layer's saved activations (Saved) and of its output: bf16 but the f32 norms'
/// inverse RMS and the attention's lse.
struct SavedSizes {
  int64_t x_in, kv_in, q_pre, q_rot, k_pre, k_rot, v, o, o_rows, x_mid, hp, gu, act, out;  // bf16
  int64_t inv_in, q_inv, k_inv, lse, inv_post;                                               // f32
  int64_t bytes() const {
    return 2 * (x_in + kv_in + q_pre + q_rot + k_pre + k_rot + v + o + o_rows + x_mid + hp + gu + act + out) +
           4 * (inv_in + q_inv + k_inv + lse + inv_post);
  }
};

/// Elements of the backward's buffers (beside the saved activations): bf16 dx .. dhn, fp32 dctx and
/// the norms' workspace, the attention backward's workspace in bytes.
struct BackwardSizes {
  int64_t dx, tmp, dact, dhp, dof, dq, dk, dv, dhn;  // bf16
  int64_t dctx, nws;                                 // f32
  int64_t attention_ws_bytes;
  int64_t bytes() const { return 2 * (dx + tmp + dact + dhp + dof + dq + dk + dv + dhn) + 4 * (dctx + nws) + attention_ws_bytes; }
};

/// The buffer sizes of one step() for S context rows, N blocks of B (Q = N B query rows, SQ = S + Q
/// key rows) and Qc rows with a loss weight: step() allocates from these, and step_bytes() adds them
/// up along the step's timeline (DrafterGpu::step_bytes).
struct StepSizes {
  int64_t S, Q, SQ, Qc, Qf, d, hd, H, Hkv, Im, L;
  bool compact;
  int64_t masks;                  // distinct (window, causal) masks of the layers, Q ranges each
  int64_t ce_row_chunk, ce_ws_bytes;
  int64_t dspark_row_chunk = 0, dspark_ws_bytes = 0;  // DSpark's loss (dspark_step_loss) instead of the cross entropy
  StepSizes(const DrafterConfig& c, int64_t V, int64_t S_, int64_t N, int64_t Qc_, int64_t ce_chunk_bytes)
      : S(S_), Q(N * c.block_size), SQ(S_ + N * c.block_size), Qc(Qc_), Qf(Qc_ > 0 ? Qc_ : N * c.block_size),
        d(c.hidden_size), hd(c.head_dim), H(c.num_attention_heads), Hkv(c.num_key_value_heads),
        Im(c.intermediate_size), L(c.num_hidden_layers), compact(Qc_ > 0),
        masks(0), ce_row_chunk(Qc_ > 0 ? cuda::cross_entropy_row_chunk(V, Qc_, ce_chunk_bytes) : 0),
        ce_ws_bytes(Qc_ > 0 ? cuda::cross_entropy_workspace_bytes(ce_row_chunk, V, true) : 0) {
    std::set<std::pair<int64_t, bool>> kinds;
    for (int64_t i = 0; i < L; ++i) kinds.insert({c.layer_window(i), c.layer_causal(i)});
    masks = int64_t(kinds.size());
    if (c.is_dspark() && Qc > 0) {
      dspark_row_chunk = dspark_loss_row_chunk(V, Qc, ce_chunk_bytes);
      dspark_ws_bytes = dspark_loss_workspace_bytes(c, V, Qc, dspark_row_chunk);
      ce_row_chunk = 0, ce_ws_bytes = 0;
    }
  }
  /// Layer i: on from its attention's output the Qc rows with a loss weight in the last layer.
  SavedSizes saved(int64_t i) const {
    const bool rows = compact && i == L - 1;
    const int64_t Qp = rows ? Qc : Q;
    return {Q * d, SQ * d, Q * H * hd, Q * H * hd, SQ * Hkv * hd, SQ * Hkv * hd, SQ * Hkv * hd, Q * H * hd,
            rows ? Qc * H * hd : 0, Qp * d, Qp * d, Qp * 2 * Im, Qp * Im, Qp * d,
            Q, Q * H, SQ * Hkv, Q * H, Qp};
  }
  BackwardSizes backward() const {
    return {Q * d, Q * d, Q * Im, Q * d, Q * H * hd, Q * H * hd, SQ * Hkv * hd, SQ * Hkv * hd, Q * d, S * d,
            cuda::rms_norm_workspace_floats(SQ * std::max(H, Hkv), std::max(d, hd)),
            cuda::masked_attention_backward_workspace_bytes(Q, SQ, int(H), int(Hkv), int(hd))};
  }
  /// Bytes alive through the whole step: the block layout's uploads (ids, positions, the loss rows),
  /// the masks, the RoPE tables, fc's output, the context and its inverse RMS.
  int64_t resident_bytes() const {
    return 4 * Q + 8 * (Q + SQ) + 4 * Qc + int64_t(sizeof(cuda::KvRange32)) * Q * masks + 4 * (Q + SQ) * hd +
           2 * (2 * S * d) + 4 * S + 8;
  }
  /// The final norm's output and inverse RMS, beside the last layer's output.
  int64_t final_norm_bytes() const { return 2 * Qf * d + 4 * Qf; }
  /// The cross entropy: the gradient of the final norm's output, its labels, weights, statistics, workspace.
  int64_t cross_entropy_bytes() const { return 2 * Qf * d + 4 * 5 * Qc + ce_ws_bytes + dspark_ws_bytes; }
  /// The most one step holds at once: the saved activations (with recomputation the layer inputs and
  /// one layer's activations) with the cross entropy, or with the backward's buffers.
  int64_t peak_bytes(bool recompute) const {
    int64_t held = 0, largest = 0;
    for (int64_t i = 0; i < L; ++i) {
      const SavedSizes z = saved(i);
      held += recompute ? 2 * z.x_in : z.bytes() - 2 * z.out;  // (a layer's output is the next one's x_in)
      largest = std::max(largest, z.bytes());
    }
    const int64_t forward = resident_bytes() + held + 2 * saved(L - 1).out + final_norm_bytes() +
                            (recompute ? largest : 0);
    return forward + std::max(cross_entropy_bytes(), 2 * Qf * d + backward().bytes());  // (dhf lives on)
  }
};


/// One step's layout on the device, shared by its layers (step_bytes' resident part): the block
/// ids, the query and key positions, the loss rows, one mask per distinct (window, causal) of the
/// layers, the RoPE tables, and the context every layer's keys and values start with (ctx =
/// hidden_norm(fc(taps)) [S, d], fc's output and the norm's inverse RMS kept for the backward).
struct StepWorkspace {
  int64_t S, Q, SQ, Qc;  // context rows, query rows (blocks x B), key rows (S + Q), rows with a loss weight
  bool compact;             // Qc > 0: the last layer's post-attention rows are the Qc used ones
  StreamBuffer<int32_t> used, ids;       // [Qc] the used rows; [Q] each row's input token
  StreamBuffer<int64_t> pos_q, pos_kv;   // [Q], [SQ] RoPE positions
  std::map<std::pair<int64_t, bool>, StreamBuffer<cuda::KvRange32>> masks;  // [Q] each
  StreamBuffer<float> cq, sq, ckv, skv;  // RoPE cos / sin of the queries [Q, hd / 2] and keys [SQ, hd / 2]
  StreamBuffer<bf16> fc_out, ctx;        // [S, d]
  StreamBuffer<float> inv_ctx;           // [S]

  StepWorkspace(const DrafterGpu::Impl& I, const DrafterConfig& c, const DrafterGpuSequence& seq, const BlockLayout& lay,
                const std::vector<int32_t>& used_rows, int64_t num_blocks, int64_t used_count)
      : S(int64_t(seq.ids.size())), Q(num_blocks * c.block_size), SQ(S + Q), Qc(used_count),
        compact(used_count > 0) {
    cudaStream_t s = I.s;
    const int64_t hd = c.head_dim, d = c.hidden_size;
    used = upload(used_rows, s), ids = upload(lay.block_ids, s);
    pos_q = upload(lay.pos_q, s), pos_kv = upload(lay.pos_kv, s);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {  // each distinct mask uploaded once
      const std::pair key{c.layer_window(i), c.layer_causal(i)};
      if (!masks.count(key))
        masks.emplace(key, upload(cuda::to_kv_range32(cpu::dflash_kv_ranges(seq.anchors, num_blocks, c.block_size, S,
                                                                              key.first, key.second)), s));
    }
    cq = StreamBuffer<float>(size_t(Q * hd / 2), s), sq = StreamBuffer<float>(size_t(Q * hd / 2), s);
    ckv = StreamBuffer<float>(size_t(SQ * hd / 2), s), skv = StreamBuffer<float>(size_t(SQ * hd / 2), s);
    cuda::rope_table(pos_q.data(), I.inv_freq.data(), Q, hd, cq.data(), sq.data(), s, I.rope_scale);
    cuda::rope_table(pos_kv.data(), I.inv_freq.data(), SQ, hd, ckv.data(), skv.data(), s, I.rope_scale);
    fc_out = StreamBuffer<bf16>(size_t(S * d), s), ctx = StreamBuffer<bf16>(size_t(S * d), s);
    inv_ctx = StreamBuffer<float>(size_t(S), s);
  }
  /// Layer i's key ranges.
  const cuda::KvRange32* ranges(const DrafterConfig& c, int64_t i) const {
    return masks.at({c.layer_window(i), c.layer_causal(i)}).data();
  }
};

/// y [rows, out] (+)= x [rows, in] @ W^T (beta 0 or 1), W the bf16 copy of the parameter at offset w.
void linear(DrafterGpu::Impl& I, const bf16* x, int64_t rows, int64_t in, int64_t out, int64_t w, bf16* y, float beta) {
  I.gemm.gemm({rows, out, in, false, true}, x, I.W(w), y, 1.f, beta);
}

/// dx (=|+=) dy W: dy [rows, out], W [out, in] (the parameter at offset w).
template <typename T>
void dgrad(DrafterGpu::Impl& I, const bf16* dy, int64_t rows, int64_t out, int64_t in, int64_t w, T* dx, float beta) {
  I.gemm.gemm({rows, in, out, false, false}, dy, I.W(w), dx, 1.f, beta);
}

/// The weight gradients of one backward: each matrix's written by one GEMM (calls counts them, by
/// offset); beta 0 after zero_grads (overwrite), else 1 (add).
struct Grads {
  DrafterGpu::Impl& I;
  float beta;
  std::map<int64_t, int> calls;
  /// dW (+)= dy^T x over `rows` rows: dy [rows, out], x [rows, in] -> [out, in].
  void weight(const bf16* dy, const bf16* x, int64_t rows, int64_t out, int64_t in, int64_t w) {
    ++calls[w];
    I.gemm.gemm({out, in, rows, true, false}, dy, x, I.G(w), 1.f, beta);
  }
  /// Layer i's gate_proj and up_proj as one [2 Im, d] matrix: dgu [rows, 2 Im] (dgate | dup), x [rows, d].
  void gate_up(const bf16* dgu, const bf16* x, int64_t rows, int64_t i, int64_t Im, int64_t d) {
    ++calls[I.p.layer(i).up_proj];
    weight(dgu, x, rows, 2 * Im, d, I.p.layer(i).gate_up);
  }
};

/// The backward's buffers beside the saved activations (BackwardSizes): dx [Q, d] the gradient of the
/// residual stream, flowing from layer to layer; dctx [S, d] fp32, summed over the layers.
struct BackwardBuffers {
  StreamBuffer<bf16> dx, tmp, dact, dhp, dof, dq, dk, dv, dhn;
  StreamBuffer<float> dctx, nws;
  StreamBuffer<char> aws;
  BackwardBuffers(const BackwardSizes& z, cudaStream_t s)
      : dx(size_t(z.dx), s), tmp(size_t(z.tmp), s), dact(size_t(z.dact), s), dhp(size_t(z.dhp), s),
        dof(size_t(z.dof), s), dq(size_t(z.dq), s), dk(size_t(z.dk), s), dv(size_t(z.dv), s), dhn(size_t(z.dhn), s),
        dctx(size_t(z.dctx), s), nws(size_t(z.nws), s), aws(size_t(z.attention_ws_bytes), s) {}
};

/// Draft layer i's forward from a.x_in [Q, d] (drafter_step's layer, src/models/drafter.cpp): keys and
/// values of [ctx ; input_layernorm(x)], q / k RMSNorm and RoPE, masked attention, o_proj and the
/// SwiGLU MLP with residuals. Fills every saved activation of `a`; returns the output [Q, d] (in the
/// last layer with ws.compact: the Qc used rows).
StreamBuffer<bf16> layer_forward(DrafterGpu::Impl& I, const DrafterConfig& c, const StepSizes& z,
                                 const StepWorkspace& ws, int64_t i, Saved& a, StageTimer& timer) {
  cudaStream_t s = I.s;
  const int64_t d = c.hidden_size, hd = c.head_dim, H = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t S = ws.S, Q = ws.Q, SQ = ws.SQ, Im = c.intermediate_size, L = c.num_hidden_layers;
  const float scale = float(1.0 / std::sqrt(double(hd)));
  const LayerParams& P = I.p.layer(i);
  const SavedSizes sz = z.saved(i);
  a.kv_in = StreamBuffer<bf16>(size_t(sz.kv_in), s);  // [ctx ; input_layernorm(x)]
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(a.kv_in.data(), ws.ctx.data(), size_t(S * d) * 2, cudaMemcpyDeviceToDevice, s));
  bf16* hn = a.kv_in.data() + S * d;
  a.inv_in = StreamBuffer<float>(size_t(sz.inv_in), s);
  cuda::rms_norm_forward(a.x_in.data(), I.F(P.input_layernorm), hn, a.inv_in.data(), Q, d,
                         c.rms_norm_eps, false, s);
  a.q_pre = StreamBuffer<bf16>(size_t(sz.q_pre), s);
  a.q_rot = StreamBuffer<bf16>(size_t(sz.q_rot), s);
  a.q_inv = StreamBuffer<float>(size_t(sz.q_inv), s);
  linear(I, hn, Q, d, H * hd, P.q_proj, a.q_pre.data(), 0.f);
  cuda::rms_norm_forward(a.q_pre.data(), I.F(P.q_norm), a.q_rot.data(), a.q_inv.data(),
                         Q * H, hd, c.rms_norm_eps, false, s);
  cuda::rope_apply(a.q_rot.data(), Q, H, hd, hd, ws.cq.data(), ws.sq.data(), false, s);
  a.k_pre = StreamBuffer<bf16>(size_t(sz.k_pre), s);
  a.k_rot = StreamBuffer<bf16>(size_t(sz.k_rot), s);
  a.k_inv = StreamBuffer<float>(size_t(sz.k_inv), s);
  a.v = StreamBuffer<bf16>(size_t(sz.v), s);
  linear(I, a.kv_in.data(), SQ, d, Hkv * hd, P.k_proj, a.k_pre.data(), 0.f);
  cuda::rms_norm_forward(a.k_pre.data(), I.F(P.k_norm), a.k_rot.data(), a.k_inv.data(),
                         SQ * Hkv, hd, c.rms_norm_eps, false, s);
  cuda::rope_apply(a.k_rot.data(), SQ, Hkv, hd, hd, ws.ckv.data(), ws.skv.data(), false, s);
  linear(I, a.kv_in.data(), SQ, d, Hkv * hd, P.v_proj, a.v.data(), 0.f);
  a.o = StreamBuffer<bf16>(size_t(sz.o), s);
  a.lse = StreamBuffer<float>(size_t(sz.lse), s);
  timer.begin("attention_fwd");
  cuda::masked_attention_forward(a.q_rot.data(), a.k_rot.data(), a.v.data(), ws.ranges(c, i), Q, SQ, int(H),
                                 int(Hkv), int(hd), scale, a.o.data(), a.lse.data(), s);
  timer.end("attention_fwd");
  // Rows on from here: all Q, or in the last layer the Qp = Qc rows with a loss weight.
  const bool rows = ws.compact && i == L - 1;
  const int64_t Qp = rows ? ws.Qc : Q;
  a.x_mid = StreamBuffer<bf16>(size_t(sz.x_mid), s);  // x_in + o_proj(o)
  if (rows) {
    a.o_rows = StreamBuffer<bf16>(size_t(sz.o_rows), s);
    cuda::embedding_gather(a.o.data(), Q, H * hd, ws.used.data(), ws.Qc, a.o_rows.data(), nullptr, s);
    cuda::embedding_gather(a.x_in.data(), Q, d, ws.used.data(), ws.Qc, a.x_mid.data(), nullptr, s);
  } else {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(a.x_mid.data(), a.x_in.data(), size_t(Q * d) * 2, cudaMemcpyDeviceToDevice, s));
  }
  linear(I, rows ? a.o_rows.data() : a.o.data(), Qp, H * hd, d, P.o_proj, a.x_mid.data(), 1.f);
  a.hp = StreamBuffer<bf16>(size_t(sz.hp), s);
  a.inv_post = StreamBuffer<float>(size_t(sz.inv_post), s);
  cuda::rms_norm_forward(a.x_mid.data(), I.F(P.post_attention_layernorm), a.hp.data(),
                         a.inv_post.data(), Qp, d, c.rms_norm_eps, false, s);
  a.gu = StreamBuffer<bf16>(size_t(sz.gu), s);
  a.act = StreamBuffer<bf16>(size_t(sz.act), s);
  linear(I, a.hp.data(), Qp, d, 2 * Im, P.gate_up, a.gu.data(), 0.f);
  cuda::swiglu_forward(a.gu.data(), Qp, Im, a.act.data(), s);
  StreamBuffer<bf16> out(size_t(sz.out), s);  // x_mid + down_proj(act)
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(out.data(), a.x_mid.data(), size_t(Qp * d) * 2, cudaMemcpyDeviceToDevice, s));
  linear(I, a.act.data(), Qp, Im, d, P.down_proj, out.data(), 1.f);
  return out;
}

/// Draft layer i's backward: from bb.dx = d loss / d output to bb.dx = d loss / d a.x_in, adding the
/// keys' and values' share to bb.dctx and every weight's gradient to `grads`.
void layer_backward(DrafterGpu::Impl& I, const DrafterConfig& c, const StepWorkspace& ws, BackwardBuffers& bb,
                    Grads& grads, int64_t i, Saved& a, StageTimer& timer) {
  cudaStream_t s = I.s;
  const int64_t d = c.hidden_size, hd = c.head_dim, H = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t S = ws.S, Q = ws.Q, SQ = ws.SQ, Qc = ws.Qc, Im = c.intermediate_size, L = c.num_hidden_layers;
  const float scale = float(1.0 / std::sqrt(double(hd)));
  const LayerParams& P = I.p.layer(i);
  const bf16* hn = a.kv_in.data() + S * d;
  const bool rows = ws.compact && i == L - 1;  // the post-attention part on the Qc rows with a loss weight
  const int64_t Qp = rows ? Qc : Q;
  // MLP: x_out = x_mid + down(silu(gate(hp)) * up(hp))
  dgrad(I, bb.dx.data(), Qp, d, Im, P.down_proj, bb.dact.data(), 0.f);
  grads.weight(bb.dx.data(), a.act.data(), Qp, d, Im, P.down_proj);
  cuda::swiglu_backward(a.gu.data(), bb.dact.data(), Qp, Im, s);  // in place: gu becomes dgate | dup
  dgrad(I, a.gu.data(), Qp, 2 * Im, d, P.gate_up, bb.dhp.data(), 0.f);
  grads.gate_up(a.gu.data(), a.hp.data(), Qp, i, Im, d);
  cuda::rms_norm_backward(a.x_mid.data(), I.F(P.post_attention_layernorm), a.inv_post.data(),
                          bb.dhp.data(), bb.tmp.data(), I.G(P.post_attention_layernorm), bb.nws.data(), Qp, d,
                          false, s);
  cuda::add_inplace(bb.dx.data(), bb.tmp.data(), Qp * d, s);  // d loss / d x_mid
  // attention: x_mid = x_in + o_proj(attn(q, k, v))
  if (rows) {  // back to all Q rows: the others' gradients are zero
    dgrad(I, bb.dx.data(), Qc, d, H * hd, P.o_proj, bb.dq.data(), 0.f);  // [Qc, H*hd]
    grads.weight(bb.dx.data(), a.o_rows.data(), Qc, d, H * hd, P.o_proj);
    DFLASH_CUDA_CHECK(cudaMemsetAsync(bb.dof.data(), 0, size_t(Q * H * hd) * 2, s));
    cuda::scatter_rows(bb.dq.data(), Qc, H * hd, ws.used.data(), bb.dof.data(), s);
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(bb.tmp.data(), bb.dx.data(), size_t(Qc * d) * 2, cudaMemcpyDeviceToDevice, s));
    DFLASH_CUDA_CHECK(cudaMemsetAsync(bb.dx.data(), 0, size_t(Q * d) * 2, s));
    cuda::scatter_rows(bb.tmp.data(), Qc, d, ws.used.data(), bb.dx.data(), s);
  } else {
    dgrad(I, bb.dx.data(), Q, d, H * hd, P.o_proj, bb.dof.data(), 0.f);
    grads.weight(bb.dx.data(), a.o.data(), Q, d, H * hd, P.o_proj);
  }
  timer.begin("attention_bwd");
  cuda::masked_attention_backward(a.q_rot.data(), a.k_rot.data(), a.v.data(), a.o.data(), a.lse.data(), bb.dof.data(),
                                  ws.ranges(c, i), Q, SQ, int(H), int(Hkv), int(hd), scale, bb.dq.data(), bb.dk.data(),
                                  bb.dv.data(), bb.aws.data(), s);
  timer.end("attention_bwd");
  cuda::rope_apply(bb.dq.data(), Q, H, hd, hd, ws.cq.data(), ws.sq.data(), true, s);
  cuda::rope_apply(bb.dk.data(), SQ, Hkv, hd, hd, ws.ckv.data(), ws.skv.data(), true, s);
  cuda::rms_norm_backward(a.q_pre.data(), I.F(P.q_norm), a.q_inv.data(), bb.dq.data(),
                          bb.dq.data(), I.G(P.q_norm), bb.nws.data(), Q * H, hd, false, s);
  cuda::rms_norm_backward(a.k_pre.data(), I.F(P.k_norm), a.k_inv.data(), bb.dk.data(),
                          bb.dk.data(), I.G(P.k_norm), bb.nws.data(), SQ * Hkv, hd, false, s);
  const int64_t wq = P.q_proj, wk = P.k_proj, wv = P.v_proj;
  grads.weight(bb.dq.data(), hn, Q, H * hd, d, wq);
  grads.weight(bb.dk.data(), a.kv_in.data(), SQ, Hkv * hd, d, wk);
  grads.weight(bb.dv.data(), a.kv_in.data(), SQ, Hkv * hd, d, wv);
  dgrad(I, bb.dq.data(), Q, H * hd, d, wq, bb.dhn.data(), 0.f);
  dgrad(I, bb.dk.data() + S * Hkv * hd, Q, Hkv * hd, d, wk, bb.dhn.data(), 1.f);
  dgrad(I, bb.dv.data() + S * Hkv * hd, Q, Hkv * hd, d, wv, bb.dhn.data(), 1.f);
  dgrad(I, bb.dk.data(), S, Hkv * hd, d, wk, bb.dctx.data(), 1.f);
  dgrad(I, bb.dv.data(), S, Hkv * hd, d, wv, bb.dctx.data(), 1.f);
  cuda::rms_norm_backward(a.x_in.data(), I.F(P.input_layernorm), a.inv_in.data(), bb.dhn.data(),
                          bb.tmp.data(), I.G(P.input_layernorm), bb.nws.data(), Q, d, false, s);
  cuda::add_inplace(bb.dx.data(), bb.tmp.data(), Q * d, s);  // d loss / d x_in (dropped after layer 0: embeddings are frozen)
}

}  // namespace

int64_t DrafterGpu::step_bytes(const DrafterConfig& cfg, int64_t V, int64_t S, int64_t num_blocks, bool recompute,
                               int64_t ce_chunk_bytes) {
  return StepSizes(cfg, V, S, num_blocks, num_blocks * cfg.drafts_per_block(), ce_chunk_bytes).peak_bytes(recompute);
}

DrafterGpuStepResult DrafterGpu::step(const DrafterGpuSequence& seq, const DrafterGpuStepOptions& opt) {
  Impl& I = *impl_;
  cudaStream_t s = I.s;
  const DrafterConfig& c = cfg_;
  const int64_t d = c.hidden_size, K = int64_t(c.target_layer_ids.size()), B = c.block_size, L = c.num_hidden_layers;
  const int64_t S = int64_t(seq.ids.size()), N = seq.num_blocks, Q = N * B;
  if (!seq.taps) throw std::invalid_argument("DrafterGpu::step: no taps");
  if (S == 0 || int64_t(seq.loss_mask.size()) != S) throw std::invalid_argument("DrafterGpu::step: ids / loss_mask sizes");
  if (N < int64_t(seq.anchors.size()) || N == 0) throw std::invalid_argument("DrafterGpu::step: num_blocks");
  for (size_t b = 0; b < seq.anchors.size(); ++b)
    if (seq.anchors[b] < 0 || seq.anchors[b] >= S || (b && seq.anchors[b] < seq.anchors[b - 1]))
      throw std::invalid_argument("DrafterGpu::step: anchors must be sorted and inside [0, S)");
  for (int64_t t : seq.ids)
    if (t < 0 || t >= I.V) throw std::invalid_argument("DrafterGpu::step: token id " + std::to_string(t) + " outside vocab");

  // ---- host-side block layout (as drafter_step) ----
  const BlockLayout lay = block_layout(seq.ids, seq.loss_mask, seq.anchors, N, B, c.mask_token_id, seq.gamma);
  std::vector<int32_t> labels = lay.labels;
  std::vector<double> wts = lay.weights;  // (D-PACE replaces them below, on the same rows)
  double wsum = lay.weight_sum;
  DSparkRows drows;  // DSpark: every slot predicts the token after it (src/models/dspark.h)
  if (c.is_dspark()) {
    if (!seq.target_hidden) throw std::invalid_argument("DrafterGpu::step: a DSpark drafter needs the target's final hidden states");
    if (seq.dpace) throw std::invalid_argument("DrafterGpu::step: D-PACE weighs a DFlash drafter's loss, not DSpark's");
    drows = dspark_rows(seq.ids, seq.loss_mask, seq.anchors, N, B, seq.gamma);
    labels = drows.labels, wts = drows.weights, wsum = drows.weight_sum;
  }
  // The rows with a loss weight (block position 0, padding and prompt labels have none): the cross
  // entropy runs over these only, and so does the last layer after its attention (o_proj, MLP, the
  // final norm), whose other rows reach no loss.
  std::vector<int32_t> used, used_labels;
  std::vector<float> coef;
  for (int64_t r = 0; r < Q; ++r)
    if (wts[size_t(r)] > 0) {
      used.push_back(int32_t(r));
      used_labels.push_back(labels[size_t(r)]);
      coef.push_back(wsum > 0 ? float(wts[size_t(r)] / wsum) : 0.f);
    }
  const int64_t Qc = int64_t(used.size());
  const StepSizes z(c, I.V, S, N, Qc, opt.ce_chunk_bytes);
  // (Block position 0 has no weight, so Qc < Q; with Qc == 0 there is no loss and no backward, and
  // the last layer runs whole.)
  const int64_t Qf = Qc > 0 ? Qc : Q;  // rows of the last layer's output and of the final norm
  const StepWorkspace ws(I, c, seq, lay, used, N, Qc);
  StageTimer timer(s, opt.time_stages);
  // ---- forward ----
  timer.begin("forward");
  linear(I, seq.taps, S, K * d, d, I.p.fc, ws.fc_out.data(), 0.f);
  cuda::rms_norm_forward(ws.fc_out.data(), I.F(I.p.hidden_norm), ws.ctx.data(), ws.inv_ctx.data(), S, d,
                         c.rms_norm_eps, false, s);
  StreamBuffer<bf16> x(size_t(Q * d), s);
  StreamBuffer<int> bad(2, s);  // [mask token outside the embedding, non-finite taps]
  DFLASH_CUDA_CHECK(cudaMemsetAsync(bad.data(), 0, 2 * sizeof(int), s));
  cuda::flag_nonfinite(seq.taps, S * K * d, bad.data() + 1, s);
  if (seq.target_hidden) cuda::flag_nonfinite(seq.target_hidden, S * d, bad.data() + 1, s);  // (DSpark)
  cuda::embedding_gather(I.embed.data(), I.V, d, ws.ids.data(), Q, x.data(), bad.data(), s);
  std::vector<Saved> sv(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    Saved& a = sv[size_t(i)];
    a.x_in = std::move(x);
    x = layer_forward(I, c, z, ws, i, a, timer);
    if (opt.recompute) {  // keep only the layer input; the backward runs the layer again
      StreamBuffer<bf16> keep = std::move(a.x_in);
      a = Saved();
      a.x_in = std::move(keep);
    }
  }
  StreamBuffer<bf16> hf(size_t(Qf * d), s);  // [Qf, d]: the rows with a loss weight (when there are any)
  StreamBuffer<float> inv_final(size_t(Qf), s);
  cuda::rms_norm_forward(x.data(), I.F(I.p.norm), hf.data(), inv_final.data(), Qf, d, c.rms_norm_eps, false, s);

  // Cross entropy over the rows with a loss weight (hf's), fused with its backward when one is
  // wanted (coef = w / sum(w) is known up front): dhf is their gradient.
  const bool backward = opt.backward && Qc > 0;
  // After zero_grads(), each weight matrix's gradient GEMM (one per matrix) overwrites instead of
  // adding, and the gradients summed over several calls (the norm weights', DSpark's atomics) start at zero.
  const float grad_beta = I.grad_zero_pending ? 0.f : 1.f;
  if (backward && I.grad_zero_pending)
    for (const auto& [name, shape] : I.shapes)
      if (shape.size() == 1 || name == "markov_head.markov_w1.weight" || name == "confidence_head.proj.weight")
        DFLASH_CUDA_CHECK(cudaMemsetAsync(I.G(I.offset.at(name)), 0, size_t(BasicTensor<float>::numel_of(shape)) * sizeof(float), s));
  Grads grads{I, grad_beta, {}};  // each weight matrix's gradient must be written exactly once
  timer.end("forward");
  timer.begin("cross_entropy");
  StreamBuffer<bf16> dhf(backward ? size_t(Qf * d) : 0, s);
  std::vector<float> h_lse(static_cast<size_t>(Qc)), h_tl(static_cast<size_t>(Qc));
  std::vector<int32_t> h_amax(static_cast<size_t>(Qc));
  std::vector<double> row_loss(static_cast<size_t>(Qc));  // each used row's unweighted loss
  if (Qc > 0 && c.is_dspark()) {
    std::vector<int32_t> prev, trow;
    for (int32_t r : used) prev.push_back(drows.prev[size_t(r)]), trow.push_back(int32_t(drows.target_row[size_t(r)]));
    dspark_step_loss(I, c, hf.data(), Qc, seq.target_hidden, S, used_labels, prev, trow, coef, z.dspark_row_chunk,
                     backward ? dhf.data() : nullptr, grad_beta, &row_loss, &h_amax);
    for (int64_t w : {I.p.markov_w1, I.p.markov_w2, I.p.confidence_w})
      grads.calls[w] += backward;
  } else if (Qc > 0) {
    auto d_ul = upload(used_labels, s);
    auto d_coef = upload(coef, s);
    const int64_t rc = z.ce_row_chunk;
    StreamBuffer<char> ce_ws(size_t(z.ce_ws_bytes), s);
    StreamBuffer<float> lse(size_t(Qc), s), tl(size_t(Qc), s);
    StreamBuffer<int32_t> amax(size_t(Qc), s);
    if (seq.dpace) {  // D-PACE: the weights from each row's CE (a forward-only pass first), detached
      cuda::cross_entropy(I.gemm, hf.data(), I.lm_head.data(), Qc, d, I.V, d_ul.data(), d_coef.data(), rc,
                          ce_ws.data(), {lse.data(), tl.data(), amax.data()}, nullptr);
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_lse.data(), lse.data(), size_t(Qc) * 4, cudaMemcpyDeviceToHost, s));
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_tl.data(), tl.data(), size_t(Qc) * 4, cudaMemcpyDeviceToHost, s));
      DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<double> row_ce(static_cast<size_t>(Q), 0.0);
      std::vector<bool> valid(static_cast<size_t>(Q), false);
      for (int64_t i = 0; i < Qc; ++i) {
        const size_t r = size_t(used[size_t(i)]);
        valid[r] = true, row_ce[r] = double(h_lse[size_t(i)]) - double(h_tl[size_t(i)]);
      }
      const std::vector<double> dw = dpace_weights(row_ce, valid, B);
      wsum = 0;
      for (int64_t i = 0; i < Qc; ++i) wsum += (wts[size_t(used[size_t(i)])] = dw[size_t(used[size_t(i)])]);
      for (int64_t i = 0; i < Qc; ++i) coef[size_t(i)] = float(wts[size_t(used[size_t(i)])] / wsum);
      d_coef = upload(coef, s);
    }
    cuda::cross_entropy(I.gemm, hf.data(), I.lm_head.data(), Qc, d, I.V, d_ul.data(), d_coef.data(), rc,
                        ce_ws.data(), {lse.data(), tl.data(), amax.data()}, backward ? dhf.data() : nullptr);
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_lse.data(), lse.data(), size_t(Qc) * 4, cudaMemcpyDeviceToHost, s));
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_tl.data(), tl.data(), size_t(Qc) * 4, cudaMemcpyDeviceToHost, s));
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_amax.data(), amax.data(), size_t(Qc) * 4, cudaMemcpyDeviceToHost, s));
  }
  timer.end("cross_entropy");
  int h_bad[2] = {0, 0};
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(h_bad, bad.data(), 2 * sizeof(int), cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  if (h_bad[0]) throw std::invalid_argument("DrafterGpu::step: mask_token_id outside the embedding");
  if (!c.is_dspark())
    for (int64_t i = 0; i < Qc; ++i) row_loss[size_t(i)] = double(h_lse[size_t(i)]) - double(h_tl[size_t(i)]);
  DrafterGpuStepResult res;
  res.nonfinite_taps = h_bad[1] != 0;
  res.weight_sum = wsum;
  res.slot_correct.assign(size_t(B), 0);
  res.slot_count.assign(size_t(B), 0);
  double lsum = 0;
  for (int64_t i = 0; i < Qc; ++i) {
    const size_t r = size_t(used[size_t(i)]);
    if (wts[r] <= 0) continue;
    lsum += wts[r] * row_loss[size_t(i)];
    res.slot_count[r % size_t(B)] += 1;
    res.slot_correct[r % size_t(B)] += h_amax[size_t(i)] == labels[r];
  }
  res.loss = wsum > 0 ? lsum / wsum : 0.0;
  if (!backward) {
    res.stage_ms = timer.totals();
    return res;
  }

  // ---- backward ----
  timer.begin("backward");
  // (The flag is cleared once every gradient is written: a backward that throws half-way leaves the
  // buffer counted as zero.)
  BackwardBuffers bb(z.backward(), s);
  cuda::rms_norm_backward(x.data(), I.F(I.p.norm), inv_final.data(), dhf.data(), bb.dx.data(), I.G(I.p.norm),
                          bb.nws.data(), Qf, d, false, s);  // dx's first Qc rows
  DFLASH_CUDA_CHECK(cudaMemsetAsync(bb.dctx.data(), 0, size_t(S * d) * 4, s));
  for (int64_t i = L - 1; i >= 0; --i) {
    Saved& a = sv[size_t(i)];
    if (opt.recompute) layer_forward(I, c, z, ws, i, a, timer);  // the same kernels on the same input: bitwise the same activations
    layer_backward(I, c, ws, bb, grads, i, a, timer);
    sv[size_t(i)] = Saved();  // free this layer's activations
  }
  StreamBuffer<bf16> dctx_b(size_t(S * d), s), dfc(size_t(S * d), s);
  cuda::f32_to_bf16(bb.dctx.data(), dctx_b.data(), S * d, s);
  cuda::rms_norm_backward(ws.fc_out.data(), I.F(I.p.hidden_norm), ws.inv_ctx.data(), dctx_b.data(), dfc.data(),
                          I.G(I.p.hidden_norm), bb.nws.data(), S, d, false, s);
  grads.weight(dfc.data(), seq.taps, S, d, K * d, I.p.fc);
  for (const auto& [name, shape] : I.shapes)
    if (shape.size() == 2 && grads.calls[I.offset.at(name)] != 1)
      throw std::logic_error("DrafterGpu::step: the gradient of " + name + " was written " +
                             std::to_string(grads.calls[I.offset.at(name)]) + " times, not once");
  I.grad_zero_pending = false;
  timer.end("backward");
  if (opt.time_stages) {
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
    res.stage_ms = timer.totals();
  }
  return res;
}

}  // namespace dflash
