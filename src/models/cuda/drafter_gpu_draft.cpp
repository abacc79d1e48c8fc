// Drafting on the GPU from a context cache: the CPU drafter_extend_context / drafter_draft_logits
// (src/models/drafter.cpp) for a batch of sequences, built from the kernels of the training step.
// Shapes in PyTorch order; n sequences, T new context rows, Q = (drafting sequences) x B block rows.
#include <algorithm>
#include <map>
#include <cmath>
#include <stdexcept>

#include "models/cuda/drafter_gpu.h"
#include "models/cuda/drafter_gpu_impl.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/masked_attention.h"
#include "ops/cuda/norm.h"
#include "ops/cuda/rope.h"
#include "ops/dflash_attention.h"

namespace dflash {

using cuda::bf16;
using cuda::StreamBuffer;

void DrafterGpu::reset_context(int n) {
  if (n < 0) throw std::invalid_argument("DrafterGpu::reset_context: negative number of sequences");
  impl_->ctx = KvCache(n, cfg_.num_hidden_layers, cfg_.num_key_value_heads * cfg_.head_dim);
}

void DrafterGpu::truncate_context(int q, int64_t length) {
  KvCache& C = impl_->ctx;
  if (q < 0 || q >= C.n || length < 0 || length > C.len[size_t(q)])
    throw std::invalid_argument("DrafterGpu::truncate_context: sequence " + std::to_string(q) + ", length " +
                                std::to_string(length));
  C.len[size_t(q)] = length;
}

int64_t DrafterGpu::context_length(int q) const { return impl_->ctx.len.at(size_t(q)); }

namespace {
/// Each layer's keys (k_proj, k_norm, RoPE with tables cs / sn) and values of h [rows, d], scattered
/// into the cache rows `dest` [rows] (device) of C.k[i] / C.v[i].
void cache_keys_values(DrafterGpu::Impl& I, const DrafterConfig& c, int64_t i, const bf16* h, int64_t rows,
                       const float* cs, const float* sn, const int32_t* dest) {
  const int64_t d = c.hidden_size, hd = c.head_dim, Hkv = c.num_key_value_heads;
  StreamBuffer<bf16> k(size_t(rows * Hkv * hd), I.s), v(size_t(rows * Hkv * hd), I.s);
  I.gemm.gemm({rows, Hkv * hd, d, false, true}, h, I.W(I.p.layer(i).k_proj), k.data(), 1.f, 0.f);
  cuda::rms_norm_forward(k.data(), I.F(I.p.layer(i).k_norm), k.data(), nullptr, rows * Hkv, hd,
                         c.rms_norm_eps, false, I.s);
  cuda::rope_apply(k.data(), rows, Hkv, hd, hd, cs, sn, false, I.s);
  I.gemm.gemm({rows, Hkv * hd, d, false, true}, h, I.W(I.p.layer(i).v_proj), v.data(), 1.f, 0.f);
  cuda::scatter_rows(k.data(), rows, Hkv * hd, dest, I.ctx.k[size_t(i)].data(), I.s);
  cuda::scatter_rows(v.data(), rows, Hkv * hd, dest, I.ctx.v[size_t(i)].data(), I.s);
}
}  // namespace

void DrafterGpu::extend_context(const bf16* taps, const std::vector<int64_t>& cu) {
  Impl& I = *impl_;
  KvCache& C = I.ctx;
  const DrafterConfig& c = cfg_;
  const int64_t d = c.hidden_size, K = int64_t(c.target_layer_ids.size()), hd = c.head_dim;
  if (int64_t(cu.size()) != C.n + 1 || cu.front() != 0 || !std::is_sorted(cu.begin(), cu.end()))
    throw std::invalid_argument("DrafterGpu::extend_context: cu needs " + std::to_string(C.n + 1) +
                                " non-decreasing entries from 0");
  const int64_t T = cu.back();
  if (T == 0) return;
  if (!taps) throw std::invalid_argument("DrafterGpu::extend_context: no taps");
  int64_t need = 0;  // room for the new rows and a block behind them (draft() writes its keys there)
  for (int q = 0; q < C.n; ++q) need = std::max(need, C.len[size_t(q)] + cu[size_t(q) + 1] - cu[size_t(q)] + c.block_size);
  C.reserve(need, I.s);
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::vector<int32_t> dest(static_cast<size_t>(T));
  for (int q = 0; q < C.n; ++q)
    for (int64_t t = cu[size_t(q)]; t < cu[size_t(q) + 1]; ++t) {
      pos[size_t(t)] = C.len[size_t(q)] + t - cu[size_t(q)];
      dest[size_t(t)] = int32_t(int64_t(q) * C.cap + pos[size_t(t)]);
    }
  auto d_pos = cuda::upload(pos, I.s);
  auto d_dest = cuda::upload(dest, I.s);
  StreamBuffer<float> cs(size_t(T * hd / 2), I.s), sn(size_t(T * hd / 2), I.s);
  cuda::rope_table(d_pos.data(), I.inv_freq.data(), T, hd, cs.data(), sn.data(), I.s, I.rope_scale);
  // ctx = hidden_norm(fc(taps)) [T, d]
  StreamBuffer<bf16> fc_out(size_t(T * d), I.s), ctx(size_t(T * d), I.s);
  I.gemm.gemm({T, d, K * d, false, true}, taps, I.W(I.p.fc), fc_out.data(), 1.f, 0.f);
  cuda::rms_norm_forward(fc_out.data(), I.F(I.p.hidden_norm), ctx.data(), nullptr, T, d, c.rms_norm_eps, false, I.s);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    cache_keys_values(I, c, i, ctx.data(), T, cs.data(), sn.data(), d_dest.data());
  for (int q = 0; q < C.n; ++q) C.len[size_t(q)] += cu[size_t(q) + 1] - cu[size_t(q)];
}

namespace {
/// DSpark's greedy Markov walk over the blocks' final hidden states hn [na B, d] (block a = sequence
/// act[a]), as dspark_greedy_drafts: token_k = argmax(lm_head h_k + W2 W1[prev]) is one argmax of
/// [h_k ; W1[prev]] against [lm_head | W2] (V x (d + r)), prev = the anchor, then each drafted token.
std::vector<std::vector<int32_t>> dspark_walk(DrafterGpu::Impl& I, const DrafterConfig& c, const bf16* hn,
                                              const std::vector<int>& act, const std::vector<int32_t>& last,
                                              std::vector<std::vector<int32_t>> r) {
  cudaStream_t s = I.s;
  const int64_t d = c.hidden_size, rk = c.markov_rank, w = d + rk, V = I.V, B = c.block_size;
  const int64_t na = int64_t(act.size());
  StreamBuffer<bf16> wcat(size_t(V * w), s), hcat(size_t(na * w), s), e(size_t(na * rk), s);
  DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(wcat.data(), size_t(w) * 2, I.lm_head.data(), size_t(d) * 2, size_t(d) * 2,
                                      size_t(V), cudaMemcpyDeviceToDevice, s));
  DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(wcat.data() + d, size_t(w) * 2, I.W(I.p.markov_w2),
                                      size_t(rk) * 2, size_t(rk) * 2, size_t(V), cudaMemcpyDeviceToDevice, s));
  std::vector<int32_t> prev(static_cast<size_t>(na));
  for (int64_t a = 0; a < na; ++a) prev[size_t(a)] = last[size_t(act[size_t(a)])];
  for (int64_t k = 0; k < B; ++k) {
    auto d_prev = cuda::upload(prev, s);
    cuda::embedding_gather(I.W(I.p.markov_w1), V, rk, d_prev.data(), na, e.data(), nullptr, s);
    DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(hcat.data(), size_t(w) * 2, hn + k * d, size_t(B * d) * 2, size_t(d) * 2,
                                        size_t(na), cudaMemcpyDeviceToDevice, s));
    DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(hcat.data() + d, size_t(w) * 2, e.data(), size_t(rk) * 2, size_t(rk) * 2,
                                        size_t(na), cudaMemcpyDeviceToDevice, s));
    prev = cuda::lm_head_argmax(I.gemm, hcat.data(), wcat.data(), na, w, V);  // (synchronizes)
    for (int64_t a = 0; a < na; ++a) r[size_t(act[size_t(a)])].push_back(prev[size_t(a)]);
  }
  return r;
}
}  // namespace

std::vector<std::vector<int32_t>> DrafterGpu::draft(const std::vector<int32_t>& last) {
  Impl& I = *impl_;
  KvCache& C = I.ctx;
  cudaStream_t s = I.s;
  const DrafterConfig& c = cfg_;
  const int64_t d = c.hidden_size, hd = c.head_dim, H = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t B = c.block_size, Im = c.intermediate_size;
  if (int64_t(last.size()) != C.n)
    throw std::invalid_argument("DrafterGpu::draft: " + std::to_string(last.size()) + " tokens for " +
                                std::to_string(C.n) + " sequences");
  std::vector<int> act;  // drafting sequences
  int64_t need = 0;
  for (int q = 0; q < C.n; ++q) {
    if (last[size_t(q)] < 0) continue;
    if (last[size_t(q)] >= I.V) throw std::invalid_argument("DrafterGpu::draft: token id outside the vocabulary");
    act.push_back(q);
    need = std::max(need, C.len[size_t(q)] + B);
  }
  std::vector<std::vector<int32_t>> r(last.size());
  if (act.empty()) return r;
  C.reserve(need, s);
  // Block a (sequence q = act[a], context length p) has rows a*B + k at positions p + k; its keys go
  // to cache rows q*cap + p + k, behind the context (not committed: the length stays p). Its
  // queries sit in their own 64-row tiles (rows a*tile + k) so that a tile spans one sequence's keys.
  const int64_t na = int64_t(act.size()), Q = na * B, tile = (B + 63) / 64 * 64, Tq = na * tile;
  std::vector<int32_t> ids(static_cast<size_t>(Q)), dest(static_cast<size_t>(Q)), qrow(static_cast<size_t>(Q));
  std::vector<int64_t> pos(static_cast<size_t>(Q));
  // One mask per distinct (window, causal) of the layers.
  std::map<std::pair<int64_t, bool>, std::vector<cuda::KvRange32>> masks;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) masks[{c.layer_window(i), c.layer_causal(i)}].resize(size_t(Tq));
  for (int64_t a = 0; a < na; ++a) {
    const int q = act[size_t(a)];
    const int64_t p = C.len[size_t(q)], base = int64_t(q) * C.cap;
    for (int64_t k = 0; k < B; ++k) {
      const size_t row = size_t(a * B + k);
      ids[row] = k == 0 ? last[size_t(q)] : int32_t(c.mask_token_id);
      pos[row] = p + k;
      dest[row] = int32_t(base + p + k);
      qrow[row] = int32_t(a * tile + k);
    }
    // The layout [context (p rows) ; block (B rows)] of dflash_kv_ranges is the cache's from `base`.
    for (auto& [kind, out] : masks) {
      const auto rg = cuda::to_kv_range32(cpu::dflash_kv_ranges({p}, 1, B, p, kind.first, kind.second));
      for (int64_t k = 0; k < B; ++k) {
        cuda::KvRange32 x = rg[size_t(k)];
        x.ctx_begin += int32_t(base), x.ctx_end += int32_t(base), x.blk_begin += int32_t(base), x.blk_end += int32_t(base);
        out[size_t(a * tile + k)] = x;
      }
    }
  }
  auto d_ids = cuda::upload(ids, s), d_dest = cuda::upload(dest, s), d_qrow = cuda::upload(qrow, s);
  auto d_pos = cuda::upload(pos, s);
  std::map<std::pair<int64_t, bool>, StreamBuffer<cuda::KvRange32>> d_masks;
  for (const auto& [kind, m] : masks) d_masks.emplace(kind, cuda::upload(m, s));
  StreamBuffer<float> cs(size_t(Q * hd / 2), s), sn(size_t(Q * hd / 2), s);
  cuda::rope_table(d_pos.data(), I.inv_freq.data(), Q, hd, cs.data(), sn.data(), s, I.rope_scale);
  const float scale = float(1.0 / std::sqrt(double(hd)));
  auto linear = [&](const bf16* x, int64_t in, int64_t out, int64_t w, bf16* y, float beta) {
    I.gemm.gemm({Q, out, in, false, true}, x, I.W(w), y, 1.f, beta);
  };
  StreamBuffer<bf16> x(size_t(Q * d), s), hn(size_t(Q * d), s), q(size_t(Q * H * hd), s), o(size_t(Q * H * hd), s),
      gu(size_t(Q * 2 * Im), s), mlp_act(size_t(Q * Im), s);
  StreamBuffer<bf16> qpad(size_t(Tq * H * hd), s), opad(size_t(Tq * H * hd), s);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(qpad.data(), 0, qpad.size() * 2, s));  // padding rows: defined
  cuda::embedding_gather(I.embed.data(), I.V, d, d_ids.data(), Q, x.data(), nullptr, s);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    cuda::rms_norm_forward(x.data(), I.F(I.p.layer(i).input_layernorm), hn.data(), nullptr, Q, d,
                           c.rms_norm_eps, false, s);
    linear(hn.data(), d, H * hd, I.p.layer(i).q_proj, q.data(), 0.f);
    cuda::rms_norm_forward(q.data(), I.F(I.p.layer(i).q_norm), q.data(), nullptr, Q * H, hd,
                           c.rms_norm_eps, false, s);
    cuda::rope_apply(q.data(), Q, H, hd, hd, cs.data(), sn.data(), false, s);
    cache_keys_values(I, c, i, hn.data(), Q, cs.data(), sn.data(), d_dest.data());
    cuda::scatter_rows(q.data(), Q, H * hd, d_qrow.data(), qpad.data(), s);
    cuda::masked_attention_forward(qpad.data(), C.k[size_t(i)].data(), C.v[size_t(i)].data(),
                                   d_masks.at({c.layer_window(i), c.layer_causal(i)}).data(), Tq, C.n * C.cap, int(H), int(Hkv),
                                   int(hd), scale, opad.data(), nullptr, s);
    cuda::embedding_gather(opad.data(), Tq, H * hd, d_qrow.data(), Q, o.data(), nullptr, s);
    linear(o.data(), H * hd, d, I.p.layer(i).o_proj, x.data(), 1.f);  // x_mid = x + o_proj(o)
    cuda::rms_norm_forward(x.data(), I.F(I.p.layer(i).post_attention_layernorm), hn.data(), nullptr, Q, d,
                           c.rms_norm_eps, false, s);
    linear(hn.data(), d, 2 * Im, I.p.layer(i).gate_up, gu.data(), 0.f);  // gate | up
    cuda::swiglu_forward(gu.data(), Q, Im, mlp_act.data(), s);
    linear(mlp_act.data(), Im, d, I.p.layer(i).down_proj, x.data(), 1.f);  // x += down_proj(act)
  }
  cuda::rms_norm_forward(x.data(), I.F(I.p.norm), hn.data(), nullptr, Q, d, c.rms_norm_eps, false, s);
  if (c.is_dspark()) return dspark_walk(I, c, hn.data(), act, last, std::move(r));
  const std::vector<int32_t> amax = cuda::lm_head_argmax(I.gemm, hn.data(), I.lm_head.data(), Q, d, I.V);
  for (int64_t a = 0; a < na; ++a)
    r[size_t(act[size_t(a)])].assign(amax.begin() + a * B + 1, amax.begin() + (a + 1) * B);
  return r;
}

}  // namespace dflash
