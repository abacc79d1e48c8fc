// The layers of a TargetGpu forward: one workspace (the batch's layout and activation buffers), then
// per layer the pre-norm, the token mixer (gdn_layer or attention_layer), the post-norm and the FFN
// (ffn: the dense SwiGLU MLP or the experts), as TargetModel::forward does on the CPU
// (src/models/target.cpp; transformers' Qwen3_5DecoderLayer).
#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "models/cuda/target_gpu_impl.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/masked_attention.h"
#include "ops/cuda/norm.h"
#include "ops/cuda/rope.h"

namespace dflash {

using cuda::bf16;
using cuda::DeviceArray;
using cuda::StreamBuffer;

namespace {

/// Elements of run_layers' buffers for a forward of T tokens (Tq padded query rows with a cache), as
/// run_layers allocates them. v_copy / token_by_token: run_layers' choices for a cached forward.
struct ForwardSizes {
  int64_t cs = 0, sn = 0, x = 0;                                                        // f32
  int64_t h = 0, q = 0, k = 0, v = 0, o = 0, gu = 0, act = 0, qpad = 0, opad = 0, og = 0;  // bf16
  int64_t gin = 0, gnormed = 0;                                                         // bf16 (GatedDeltaNet)
  int64_t gconv = 0, gq = 0, gk = 0, gv = 0, go = 0, gg = 0, gbeta = 0;                  // f32 (GatedDeltaNet)
  int64_t aq = 0, as = 0;  // TargetDtype::kFp8: a product's input in E4M3 (bytes) and its per-token scales (f32)
  int64_t bytes() const {
    return 4 * (cs + sn + x + gconv + gq + gk + gv + go + gg + gbeta + as) +
           2 * (h + q + k + v + o + gu + act + qpad + opad + og + gin + gnormed) + aq;
  }
};

ForwardSizes forward_sizes(const ModelSpec& sp, TargetDtype dtype, int64_t T, int64_t Tq, bool cached, bool v_copy,
                           bool token_by_token) {
  const int64_t D = sp.hidden_size, H = sp.num_attention_heads, Hkv = sp.num_key_value_heads, Dh = sp.head_dim;
  const int64_t Im = sp.intermediate_size, rot = sp.rotary_dim();
  ForwardSizes z;
  if (dtype == TargetDtype::kFp8)
    z.aq = T * std::max({D, H * Dh, Im, sp.linear_num_value_heads * sp.linear_value_head_dim}), z.as = T;
  z.cs = z.sn = T * rot / 2, z.x = T * D;
  z.h = T * D, z.q = T * H * Dh, z.k = z.v = T * Hkv * Dh, z.o = T * H * Dh, z.gu = T * 2 * Im, z.act = T * Im;
  if (cached) z.qpad = z.opad = Tq * H * Dh;
  if (sp.attn_output_gate()) z.og = T * H * Dh;
  if (has_gated_deltanet(sp)) {
    const int64_t Hk = sp.linear_num_key_heads, Hv = sp.linear_num_value_heads, dk = sp.linear_key_head_dim;
    const int64_t dv = sp.linear_value_head_dim, Cg = 2 * Hk * dk + Hv * dv;
    z.gin = T * (Cg + Hv * dv + 2 * Hv), z.gnormed = T * Hv * dv;
    const int64_t Tc = cached ? T : 0;
    z.gconv = Tc * Cg, z.gq = z.gk = Tc * Hk * dk, z.gg = z.gbeta = Tc * Hv;
    z.gv = v_copy ? T * Hv * dv : 0, z.go = token_by_token ? T * Hv * dv : 0;
  }
  return z;
}

void check_batch(const ModelSpec& sp, const std::vector<int32_t>& ids, const std::vector<int64_t>& cu) {
  if (cu.size() < 2 || cu.front() != 0 || cu.back() != int64_t(ids.size()))
    throw std::invalid_argument("cu_seqlens must run from 0 to the number of tokens");
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] < cu[i - 1]) throw std::invalid_argument("cu_seqlens must be non-decreasing");
  for (int32_t t : ids)
    if (t < 0 || t >= sp.vocab_size) throw std::invalid_argument("token id " + std::to_string(t) + " outside the vocabulary");
}

/// One forward's batch layout (positions, the attention's key ranges, with a cache each token's cache
/// row and padded query row) and its activation buffers, sized by forward_sizes; alive for the forward.
struct Workspace {
  const std::vector<int64_t>& cu;
  int64_t T = 0, Tq = 0;  // tokens; padded query rows with a cache (each sequence starts a 64-row tile)
  bool cached = false, keep_rollback = false;
  bool token_by_token = false;  // a decoding step: GatedDeltaNet token by token (gated_delta_rule_recurrent)
  bool v_copy = false;          // GatedDeltaNet values copied into gv (else read in place from gconv)
  bool hybrid = false;
  StreamBuffer<int64_t> pos;
  StreamBuffer<int32_t> ids, dest, qrow;  // with a cache: each token's cache row and padded query row
  StreamBuffer<cuda::KvRange32> ranges;   // per (padded) query row: its visible keys
  StreamBuffer<int32_t> start, seq_of, cu32;     // GatedDeltaNet: sequence starts; with a cache: sequence, cu
  std::optional<cuda::GdnChunkPlan> gdn_chunks;  // the chunk list, once for every GatedDeltaNet layer
  StreamBuffer<float> cs, sn, x;                 // RoPE table; the residual stream [T, D] fp32
  StreamBuffer<bf16> h, q, k, v, o, gu, act, qpad, opad, og;  // GEMM inputs and outputs are bf16
  StreamBuffer<bf16> gin, gnormed;  // GatedDeltaNet: in_proj's output q | k | v | z | b | a; out_proj's input
  StreamBuffer<float> gconv, gq, gk, gv, go, gg, gbeta;  // GatedDeltaNet fp32 activations with a cache
  StreamBuffer<cuda::fp8> aq;  // TargetDtype::kFp8: a product's input in E4M3 and its per-token scales
  StreamBuffer<float> as;
  const bf16* quantized = nullptr;  // the input aq / as hold

  Workspace(TargetGpu::Impl& I, const ModelSpec& sp, const std::vector<int32_t>& token_ids,
            const std::vector<int64_t>& cu_seqlens, bool with_cache, bool rollback)
      : cu(cu_seqlens), T(int64_t(token_ids.size())), cached(with_cache), keep_rollback(rollback),
        hybrid(has_gated_deltanet(sp)) {
    cudaStream_t s = I.s;
    KvCache& C = I.cache;
    // Positions continue each cached sequence. Cached keys of sequence q sit at rows q * cap + j of
    // the layer's cache; new keys are scattered there. For the attention, each sequence's queries
    // start a fresh 64-row tile (rows `qrow`, Tq in all): a tile then spans one sequence's keys only.
    std::vector<int64_t> p(static_cast<size_t>(T));
    std::vector<int32_t> d, qr;
    std::vector<cuda::KvRange32> rg;
    if (cached) {
      d.resize(size_t(T));
      qr.resize(size_t(T));
    } else {
      rg = cuda::causal_ranges(cu);
    }
    for (size_t sq = 0; sq + 1 < cu.size(); ++sq) {
      for (int64_t t = cu[sq]; t < cu[sq + 1]; ++t) {
        p[size_t(t)] = t - cu[sq] + (cached ? C.len[sq] : 0);
        if (!cached) continue;
        d[size_t(t)] = int32_t(int64_t(sq) * C.cap + p[size_t(t)]);
        qr[size_t(t)] = int32_t(Tq + t - cu[sq]);
      }
      if (!cached) continue;
      rg.resize(size_t(Tq + (cu[sq + 1] - cu[sq] + 63) / 64 * 64));
      for (int64_t t = cu[sq]; t < cu[sq + 1]; ++t)
        rg[size_t(qr[size_t(t)])] = {int32_t(int64_t(sq) * C.cap), int32_t(int64_t(sq) * C.cap + p[size_t(t)] + 1), 0, 0};
      Tq = int64_t(rg.size());
    }
    pos = cuda::upload(p, s), ids = cuda::upload(token_ids, s);
    dest = cuda::upload(d, s), qrow = cuda::upload(qr, s), ranges = cuda::upload(rg, s);
    // A decoding step (at most kDecodeTokens new tokens in every sequence) runs GatedDeltaNet token by
    // token, as verification does: plain and speculative decoding then make the same states. The
    // longest sequence of the forward decides for all of it.
    int64_t max_new = 0;
    for (size_t sq = 0; sq + 1 < cu.size(); ++sq) max_new = std::max(max_new, cu[sq + 1] - cu[sq]);
    token_by_token = cached && (keep_rollback || max_new <= kDecodeTokens);
    // The chunked rule reads the values in place from the conv output (row stride Cg); the
    // token-by-token path and the rollback copy take them copied into gv.
    v_copy = token_by_token || (cached && keep_rollback);
    const ForwardSizes z = forward_sizes(sp, I.dtype, T, Tq, cached, v_copy, token_by_token);
    qpad = StreamBuffer<bf16>(size_t(z.qpad), s), opad = StreamBuffer<bf16>(size_t(z.opad), s);
    if (cached) DFLASH_CUDA_CHECK(cudaMemsetAsync(qpad.data(), 0, qpad.size() * 2, s));  // padding rows: defined
    cs = StreamBuffer<float>(size_t(z.cs), s), sn = StreamBuffer<float>(size_t(z.sn), s);
    cuda::rope_table(pos.data(), I.inv_freq.data(), T, sp.rotary_dim(), cs.data(), sn.data(), s);
    if (I.timer) I.timer->clear();  // the forward's stages start here (the uploads below count as "other")
    I.stage("other");
    x = StreamBuffer<float>(size_t(z.x), s);
    using Bf16s = std::initializer_list<std::pair<StreamBuffer<bf16>*, int64_t>>;
    using Floats = std::initializer_list<std::pair<StreamBuffer<float>*, int64_t>>;
    for (auto [b, n] : Bf16s{{&h, z.h}, {&q, z.q}, {&k, z.k}, {&v, z.v}, {&o, z.o}, {&gu, z.gu}, {&act, z.act},
                             {&og, z.og}, {&gin, z.gin}, {&gnormed, z.gnormed}})
      *b = StreamBuffer<bf16>(size_t(n), s);
    for (auto [b, n] : Floats{{&gconv, z.gconv}, {&gq, z.gq}, {&gk, z.gk}, {&gv, z.gv}, {&go, z.go}, {&gg, z.gg},
                              {&gbeta, z.gbeta}, {&as, z.as}})
      *b = StreamBuffer<float>(size_t(n), s);
    aq = StreamBuffer<cuda::fp8>(size_t(z.aq), s);
    start = cuda::upload(hybrid ? cuda::sequence_starts(cu) : std::vector<int32_t>{}, s);
    if (hybrid && !token_by_token) gdn_chunks.emplace(cu, s);
    std::vector<int32_t> so, c32;  // with a cache: each token's sequence, cu_seqlens as int32 (windowed conv)
    if (cached && hybrid) {
      for (size_t sq = 0; sq + 1 < cu.size(); ++sq) {
        c32.push_back(int32_t(cu[sq]));
        so.insert(so.end(), size_t(cu[sq + 1] - cu[sq]), int32_t(sq));
      }
      c32.push_back(int32_t(cu.back()));
    }
    seq_of = cuda::upload(so, s), cu32 = cuda::upload(c32, s);
  }
};

/// y [T, out_f] (+)= in [T, in_f] @ w^T (beta 0 or 1). Under kFp8 `in` is first quantized per token
/// into w.aq / w.as, unless `same_input`: the caller's promise that the previous product read this
/// very input, unchanged.
template <typename Y>
void linear(TargetGpu::Impl& I, Workspace& ws, const bf16* in, int64_t out_f, int64_t in_f, const LinearGpu& w, Y* y,
            float beta, bool same_input = false) {
  I.stage("gemm");
  if (I.dtype == TargetDtype::kBf16) return I.gemm.gemm({ws.T, out_f, in_f, false, true}, in, w.w.data(), y, 1.f, beta);
  if (!same_input || ws.quantized != in) cuda::quantize_rows_fp8(in, ws.T, in_f, ws.aq.data(), ws.as.data(), I.s);
  ws.quantized = in;
  I.gemm.gemm_fp8({ws.T, out_f, in_f, false, true}, ws.aq.data(), ws.as.data(), w.q.data(), w.scale.data(), y, beta);
}

/// x += GatedDeltaNet(h) of layer i (transformers Qwen3_5GatedDeltaNet): in_proj (q | k | v, z, b, a in
/// one GEMM), conv1d + SiLU over q | k | v, the gates, the gated delta rule (chunked, or token by token
/// in a decoding step), the gated RMSNorm with silu(z), out_proj. With a cache, each sequence's conv
/// window and state continue (and, with keep_rollback, what truncate_cache needs is kept).
void gdn_layer(TargetGpu::Impl& I, const ModelSpec& sp, Workspace& ws, const LayerGpu& l, int64_t i) {
  cudaStream_t s = I.s;
  const int64_t T = ws.T, D = sp.hidden_size, Hk = sp.linear_num_key_heads, Hv = sp.linear_num_value_heads;
  const int64_t dk = sp.linear_key_head_dim, dv = sp.linear_value_head_dim, Cg = 2 * Hk * dk + Hv * dv;
  const int64_t Nin = Cg + Hv * dv + 2 * Hv;  // in_proj's output row: q | k | v | z | b | a
  const int Kc = int(sp.linear_conv_kernel_dim);
  const float q_scale = float(1.0 / std::sqrt(double(dk)));
  const bf16* gz = ws.gin.data() + Cg;  // z, b, a read in place from gin (row stride Nin)
  const bf16 *gb = gz + Hv * dv, *ga = gb + Hv;
  KvCache& C = I.cache;
  linear(I, ws, ws.h.data(), Nin, D, l.in_proj, ws.gin.data(), 0.f);
  I.stage("gated_deltanet");
  TargetGpu::Impl::GdnCache* gc = ws.cached ? &I.gdn[size_t(i)] : nullptr;
  if (gc) {  // continue each sequence's conv window, then move it past the new tokens; q, k, v, gates
    cuda::causal_conv1d_silu_window(ws.gin.data(), Nin, l.conv.data(), gc->window.data(), ws.seq_of.data(),
                                    ws.cu32.data(), T, Cg, Kc, ws.gconv.data(), s);
    const size_t hist_rows = size_t(C.n * (Kc - 1) + T);
    if (ws.keep_rollback && gc->hist.size() < hist_rows * size_t(Cg)) gc->hist = DeviceArray<float>(hist_rows * size_t(Cg));
    StreamBuffer<float> tmp(ws.keep_rollback ? 0 : hist_rows * size_t(Cg), s);
    cuda::conv_window_advance(gc->window.data(), ws.gin.data(), Nin, ws.cu32.data(), C.n, T, Cg, Kc,
                              ws.keep_rollback ? gc->hist.data() : tmp.data(), s);
    cuda::gdn_prepare(ws.gconv.data(), gb, ga, Nin, l.A_log.data(), l.dt_bias.data(), T, int(Hk), int(Hv), int(dk),
                      int(dv), q_scale, ws.gq.data(), ws.gk.data(), ws.v_copy ? ws.gv.data() : nullptr, ws.gg.data(),
                      ws.gbeta.data(), s);
  }  // (without a cache the conv1d, the q / k l2norm and the gates run inside the chunked rule: from)
  if (gc && ws.keep_rollback) {  // keep the state before and every token's inputs
    const size_t n_state = size_t(C.n * Hv * dk * dv);
    if (gc->state_before.size() < n_state) gc->state_before = DeviceArray<float>(n_state);
    const GdnInputs in(T, Hk, Hv, dk, dv);
    if (gc->inputs.size() < size_t(in.total)) gc->inputs = DeviceArray<float>(size_t(in.total));
    float* keep = gc->inputs.data();
    for (const auto& [src, off, n] : {std::tuple{ws.gq.data(), in.q, in.nq}, std::tuple{ws.gk.data(), in.k, in.nq},
                                      std::tuple{ws.gv.data(), in.v, in.nv}, std::tuple{ws.gg.data(), in.g, in.ng},
                                      std::tuple{ws.gbeta.data(), in.beta, in.ng}})
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(keep + off, src, size_t(n) * 4, cudaMemcpyDeviceToDevice, s));
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(gc->state_before.data(), gc->state.data(), n_state * 4, cudaMemcpyDeviceToDevice, s));
  }
  if (ws.token_by_token) {
    cuda::gated_delta_rule_recurrent(ws.gq.data(), ws.gk.data(), ws.gv.data(), ws.gg.data(), ws.gbeta.data(), ws.cu,
                                     int(Hk), int(Hv), int(dk), int(dv), gc->state.data(), nullptr, ws.go.data(), s);
    cuda::gated_rms_norm(ws.go.data(), gz, Hv, Nin, l.gnorm.data(), ws.gnormed.data(), T * Hv, dv, sp.rms_norm_eps, s);
  } else {  // the cached state in and out (in place: each block reads its slice before writing it); the
            // gated RMSNorm applied to the output inside the kernel
    const cuda::GatedNormOut norm{gz, Nin, l.gnorm.data(), float(sp.rms_norm_eps), ws.gnormed.data()};
    const cuda::GdnProjections from{ws.gin.data(), Nin, l.conv.data(), Kc, gb, ga, Nin, l.A_log.data(),
                                    l.dt_bias.data(), q_scale, ws.start.data()};
    const float* gv_in = !gc ? nullptr : ws.v_copy ? ws.gv.data() : ws.gconv.data() + 2 * Hk * dk;
    cuda::gated_delta_rule_chunked(ws.gq.data(), ws.gk.data(), gv_in, ws.gg.data(), ws.gbeta.data(), *ws.gdn_chunks,
                                   int(Hk), int(Hv), int(dk), int(dv), gc ? gc->state.data() : nullptr,
                                   gc ? gc->state.data() : nullptr, nullptr, s, 0, gc && !ws.v_copy ? Cg : 0, &norm,
                                   gc ? nullptr : &from);
  }
  linear(I, ws, ws.gnormed.data(), D, Hv * dv, l.out, ws.x.data(), 1.f);  // x += out_proj(o)
}

/// x += attention(h) of layer i (transformers Qwen3_5Attention / Qwen3Attention): q (and the output
/// gate), k, v; q / k RMSNorm; RoPE; masked attention over the batch's causal ranges, or, with a cache,
/// over each sequence's cached keys after scattering the new ones there; sigmoid output gate; o_proj.
void attention_layer(TargetGpu::Impl& I, const ModelSpec& sp, Workspace& ws, const LayerGpu& l, int64_t i) {
  cudaStream_t s = I.s;
  const int64_t T = ws.T, D = sp.hidden_size, H = sp.num_attention_heads, Hkv = sp.num_key_value_heads;
  const int64_t Dh = sp.head_dim, rot = sp.rotary_dim();
  const bool gated = sp.attn_output_gate(), zc = sp.zero_centered_norm();
  const float scale = float(1.0 / std::sqrt(double(Dh)));
  KvCache& C = I.cache;
  linear(I, ws, ws.h.data(), H * Dh, D, l.q, ws.q.data(), 0.f);
  if (gated) linear(I, ws, ws.h.data(), H * Dh, D, l.q_gate, ws.og.data(), 0.f, true);
  linear(I, ws, ws.h.data(), Hkv * Dh, D, l.k, ws.k.data(), 0.f, true);
  linear(I, ws, ws.h.data(), Hkv * Dh, D, l.v, ws.v.data(), 0.f, true);
  I.stage("attention");
  if (sp.has_qk_norm()) {
    cuda::rms_norm_forward(ws.q.data(), l.q_norm.data(), ws.q.data(), nullptr, T * H, Dh, sp.rms_norm_eps, zc, s);
    cuda::rms_norm_forward(ws.k.data(), l.k_norm.data(), ws.k.data(), nullptr, T * Hkv, Dh, sp.rms_norm_eps, zc, s);
  }
  cuda::rope_apply(ws.q.data(), T, H, Dh, rot, ws.cs.data(), ws.sn.data(), false, s);
  cuda::rope_apply(ws.k.data(), T, Hkv, Dh, rot, ws.cs.data(), ws.sn.data(), false, s);
  if (ws.cached) {
    cuda::scatter_rows(ws.k.data(), T, Hkv * Dh, ws.dest.data(), C.k[size_t(i)].data(), s);
    cuda::scatter_rows(ws.v.data(), T, Hkv * Dh, ws.dest.data(), C.v[size_t(i)].data(), s);
    cuda::scatter_rows(ws.q.data(), T, H * Dh, ws.qrow.data(), ws.qpad.data(), s);  // unused rows: empty ranges
    cuda::masked_attention_forward(ws.qpad.data(), C.k[size_t(i)].data(), C.v[size_t(i)].data(), ws.ranges.data(),
                                   ws.Tq, C.n * C.cap, int(H), int(Hkv), int(Dh), scale, ws.opad.data(), nullptr, s);
    cuda::embedding_gather(ws.opad.data(), ws.Tq, H * Dh, ws.qrow.data(), T, ws.o.data(), nullptr, s);
  } else {
    cuda::masked_attention_forward(ws.q.data(), ws.k.data(), ws.v.data(), ws.ranges.data(), T, T, int(H), int(Hkv),
                                   int(Dh), scale, ws.o.data(), nullptr, s);
  }
  if (gated) cuda::mul_sigmoid(ws.o.data(), ws.og.data(), T * H * Dh, s);
  linear(I, ws, ws.o.data(), D, H * Dh, l.o, ws.x.data(), 1.f);  // x += o_proj(o)
}

/// x += FFN(h): the experts (moe_ffn_forward) or the dense SwiGLU MLP (gate | up in one GEMM, down).
void ffn(TargetGpu::Impl& I, const ModelSpec& sp, Workspace& ws, const LayerGpu& l) {
  const int64_t T = ws.T, D = sp.hidden_size, Im = sp.intermediate_size;
  if (l.moe) {
    I.stage("moe");
    const cuda::MoeShape shape{T, D, int(sp.num_experts), int(sp.num_experts_per_tok), sp.moe_intermediate_size,
                               sp.shared_expert_intermediate_size, sp.norm_topk_prob};
    cuda::moe_ffn_forward(I.gemm, shape, l.moe_weights(), ws.h.data(), ws.x.data());  // x += moe(h)
    return;
  }
  linear(I, ws, ws.h.data(), 2 * Im, D, l.gate_up, ws.gu.data(), 0.f);  // gate | up
  I.stage("other");
  cuda::swiglu_forward(ws.gu.data(), T, Im, ws.act.data(), I.s);
  linear(I, ws, ws.act.data(), D, Im, l.down, ws.x.data(), 1.f);  // x += down_proj(act)
}

}  // namespace

int64_t TargetGpu::forward_taps_bytes(const ModelSpec& sp, int64_t T, int64_t nseq, int64_t last, TargetDtype dtype) {
  const ForwardSizes z = forward_sizes(sp, dtype, T, 0, false, false, false);
  const bool hybrid = has_gated_deltanet(sp);
  // uploads: positions, ids, the causal ranges, each token's sequence start and the chunk list (hybrids)
  int64_t b = z.bytes() + 8 * T + 4 * T + int64_t(sizeof(cuda::KvRange32)) * T;
  if (hybrid) b += 4 * T + int64_t(sizeof(cuda::GdnChunk)) * (T / 64 + nseq + 1) + 4 * (nseq + 1);
  // a layer's kernels' temporaries, one layer at a time; the first product of each shape that adds
  // into the residual stream is tuned on a scratch copy of it (GemmContext, GemmTune::kAuto)
  int64_t temp = 4 * T * sp.hidden_size;
  for (int64_t i = 0; i <= last; ++i) {
    if (sp.layer_types[size_t(i)] == LayerKind::GatedDeltaNet)
      temp = std::max(temp, cuda::gated_delta_rule_chunked_workspace_bytes(
                                T, nseq, int(sp.linear_num_key_heads), int(sp.linear_num_value_heads),
                                int(sp.linear_key_head_dim), int(sp.linear_value_head_dim)));
    if (sp.is_moe_layer(i))
      temp = std::max(temp, cuda::moe_ffn_workspace_bytes({T, sp.hidden_size, int(sp.num_experts),
                                                           int(sp.num_experts_per_tok), sp.moe_intermediate_size,
                                                           sp.shared_expert_intermediate_size, sp.norm_topk_prob}));
  }
  return b + temp + 2 * T * sp.hidden_size;  // + forward_taps' bf16 staging (xb)
}

StreamBuffer<float> TargetGpu::run_layers(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu, int64_t last,
                                          const std::function<void(int64_t, const float*)>& on_hidden, bool cached,
                                          bool keep_rollback) {
  Impl& I = *impl_;
  const ModelSpec& sp = spec_;
  cudaStream_t s = I.s;
  check_batch(sp, ids, cu);
  if (cached) replay_accepted();  // rollbacks since the last step
  const int64_t T = int64_t(ids.size()), D = sp.hidden_size;
  const bool zc = sp.zero_centered_norm();
  KvCache& C = I.cache;
  if (cached) {
    if (I.gdn.size() != size_t(sp.num_hidden_layers)) throw std::invalid_argument("forward_cached: call reset_cache first");
    if (int64_t(cu.size()) != C.n + 1)
      throw std::invalid_argument("forward_cached: cu_seqlens needs " + std::to_string(C.n + 1) + " entries for " +
                                  std::to_string(C.n) + " cached sequences");
    int64_t need = 0;
    for (int q = 0; q < C.n; ++q) need = std::max(need, C.len[size_t(q)] + cu[size_t(q) + 1] - cu[size_t(q)]);
    C.reserve(need, s);
  }
  Workspace ws(I, sp, ids, cu, cached, keep_rollback);  // (starts the stage timer after the RoPE table)
  cuda::embedding_gather(I.embed.data(), sp.vocab_size, D, ws.ids.data(), T, ws.h.data(), nullptr, s);
  cuda::bf16_to_f32(ws.h.data(), ws.x.data(), T * D, s);
  on_hidden(0, ws.x.data());
  for (int64_t i = 0; i <= last; ++i) {
    const LayerGpu& l = I.layers[size_t(i)];
    I.stage("other");
    cuda::rms_norm_forward(ws.x.data(), l.in_ln.data(), ws.h.data(), nullptr, T, D, sp.rms_norm_eps, zc, s);
    if (l.kind == LayerKind::GatedDeltaNet) gdn_layer(I, sp, ws, l, i);
    else attention_layer(I, sp, ws, l, i);
    I.stage("other");
    cuda::rms_norm_forward(ws.x.data(), l.post_ln.data(), ws.h.data(), nullptr, T, D, sp.rms_norm_eps, zc, s);
    ffn(I, sp, ws, l);
    I.stage("other");
    on_hidden(i + 1, ws.x.data());
  }
  if (cached) {
    // As TargetCache: a forward without keep_rollback seals the tokens it adds; a sequence it gives
    // no tokens keeps what the last verification saved (hist and inputs are left alone).
    if (ws.hybrid && keep_rollback) I.rollback_cu = cu;
    for (int q = 0; q < C.n; ++q) {
      const int64_t n = cu[size_t(q) + 1] - cu[size_t(q)];
      if (ws.hybrid && keep_rollback) I.rollback_from[size_t(q)] = C.len[size_t(q)];
      else if (ws.hybrid && n > 0) I.rollback_from[size_t(q)] = -1;
      C.len[size_t(q)] += n;
    }
  }
  return std::move(ws.x);
}

}  // namespace dflash
