// DFlash drafter training step on the GPU. Mirrors drafter_step (src/models/drafter.cpp) op by op;
// comments give shapes in PyTorch order (Q = num_blocks * B query rows, S context rows).
#include "models/cuda/drafter_gpu.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>

#include "models/cuda/drafter_gpu_impl.h"
#include "models/dspark.h"
#include "ops/cuda/adamw.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/masked_attention.h"
#include "ops/cuda/norm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/stage_timer.h"
#include "ops/dflash_attention.h"
#include "ops/rope.h"
#include "tensor/dtype.h"

namespace dflash {

using cuda::bf16;
using cuda::DeviceArray;
using cuda::StreamBuffer;
using cuda::upload;

namespace {

DeviceArray<bf16> upload_bf16(const std::vector<float>& v, cudaStream_t s) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  DeviceArray<bf16> d(v.size());
  if (!h.empty()) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(d.data(), h.data(), h.size() * 2, cudaMemcpyHostToDevice, s));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return d;
}

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

}  // namespace

DrafterGpu::DrafterGpu(const DrafterConfig& cfg, const DrafterWeights<float>& w, const Tensor& embed,
                       const Tensor& lm_head, cudaStream_t stream)
    : impl_(new Impl(stream)), cfg_(cfg) {
  cfg.validate("DrafterGpu");
  if (cfg.head_dim != 64 && cfg.head_dim != 128)
    throw std::invalid_argument("DrafterGpu: head_dim " + std::to_string(cfg.head_dim) + " (GPU training needs 64 or 128)");
  const auto shapes = drafter_param_shapes(cfg);
  const auto named = w.named();
  if (named.size() != shapes.size()) throw std::invalid_argument("DrafterGpu: weights do not match the config");
  std::vector<float> flat;
  for (size_t i = 0; i < named.size(); ++i) {
    if (named[i].first != shapes[i].first || named[i].second->shape != shapes[i].second)
      throw std::invalid_argument("DrafterGpu: " + named[i].first + " has shape " + shape_str(named[i].second->shape) +
                                  ", expected " + shape_str(shapes[i].second));
    flat.insert(flat.end(), named[i].second->data.begin(), named[i].second->data.end());
  }
  if (embed.ndim() != 2 || embed.dim(1) != cfg.hidden_size || lm_head.shape != embed.shape)
    throw std::invalid_argument("DrafterGpu: embed " + shape_str(embed.shape) + " / lm_head " + shape_str(lm_head.shape) +
                                " must both be [V, " + std::to_string(cfg.hidden_size) + "]");
  allocate(embed.dim(0));
  Impl& I = *impl_;
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(I.master.data(), flat.data(), flat.size() * 4, cudaMemcpyHostToDevice, stream));
  cuda::f32_to_bf16(I.master.data(), I.wb.data(), I.n, stream);
  I.embed = upload_bf16(embed.data, stream);
  I.lm_head = upload_bf16(lm_head.data, stream);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
}

namespace {
/// Bytes per parameter on the device (allocate()): fp32 master, gradient, AdamW m and v, the bf16 copy.
constexpr int64_t kStateBytesPerParam = 4 + 4 + 4 + 4 + 2;
}  // namespace

ParamOffsets ParamOffsets::from(const std::map<std::string, int64_t>& offset, const DrafterConfig& c) {
  auto at = [&](const std::string& name) {
    const auto it = offset.find(name);
    if (it == offset.end()) throw std::logic_error("DrafterGpu: no parameter " + name);
    return it->second;
  };
  auto optional = [&](const std::string& name) { return offset.count(name) ? offset.at(name) : int64_t(-1); };
  ParamOffsets p;
  p.fc = at("fc.weight"), p.hidden_norm = at("hidden_norm.weight"), p.norm = at("norm.weight");
  p.markov_w1 = optional("markov_head.markov_w1.weight"), p.markov_w2 = optional("markov_head.markov_w2.weight");
  p.confidence_w = optional("confidence_head.proj.weight"), p.confidence_b = optional("confidence_head.proj.bias");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    LayerParams w;
    w.input_layernorm = at(l + "input_layernorm.weight"), w.post_attention_layernorm = at(l + "post_attention_layernorm.weight");
    w.q_proj = at(l + "self_attn.q_proj.weight"), w.k_proj = at(l + "self_attn.k_proj.weight");
    w.v_proj = at(l + "self_attn.v_proj.weight"), w.o_proj = at(l + "self_attn.o_proj.weight");
    w.q_norm = at(l + "self_attn.q_norm.weight"), w.k_norm = at(l + "self_attn.k_norm.weight");
    w.gate_up = at(l + "mlp.gate_proj.weight"), w.up_proj = at(l + "mlp.up_proj.weight");
    w.down_proj = at(l + "mlp.down_proj.weight");
    if (w.up_proj != w.gate_up + c.intermediate_size * c.hidden_size)  // one GEMM for both
      throw std::logic_error("DrafterGpu: up_proj does not follow gate_proj in the parameter order");
    p.layers.push_back(w);
  }
  return p;
}

int64_t DrafterGpu::state_bytes(const DrafterConfig& cfg, int64_t V) {
  int64_t n = 0;
  for (const auto& [name, shape] : drafter_param_shapes(cfg)) n += BasicTensor<float>::numel_of(shape);
  return n * kStateBytesPerParam + 2 * (2 * V * cfg.hidden_size) +
         8 * (2 + cuda::grad_sumsq_workspace_doubles() + cfg.head_dim / 2) + 4 + int64_t(kDrafterGemmWorkspaceBytes);
}

int64_t DrafterGpu::step_bytes(const DrafterConfig& cfg, int64_t V, int64_t S, int64_t num_blocks, bool recompute,
                               int64_t ce_chunk_bytes) {
  return StepSizes(cfg, V, S, num_blocks, num_blocks * cfg.drafts_per_block(), ce_chunk_bytes).peak_bytes(recompute);
}

void DrafterGpu::allocate(int64_t V) {
  Impl& I = *impl_;
  I.shapes = drafter_param_shapes(cfg_);
  I.n = 0;
  for (const auto& [name, shape] : I.shapes) {
    I.offset[name] = I.n;
    I.n += BasicTensor<float>::numel_of(shape);
  }
  I.p = ParamOffsets::from(I.offset, cfg_);
  I.V = V;
  I.master = DeviceArray<float>(size_t(I.n));
  I.wb = DeviceArray<bf16>(size_t(I.n));
  I.grad = DeviceArray<float>(size_t(I.n));
  I.m = DeviceArray<float>(size_t(I.n));
  I.v = DeviceArray<float>(size_t(I.n));
  I.grad.fill_bytes(0, I.s);
  I.m.fill_bytes(0, I.s);
  I.v.fill_bytes(0, I.s);
  I.sumsq = DeviceArray<double>(1);
  I.norm = DeviceArray<double>(1);
  I.sumsq_ws = DeviceArray<double>(size_t(cuda::grad_sumsq_workspace_doubles()));
  I.coef = DeviceArray<float>(1);
  const std::vector<double> inv_freq = cpu::rope_frequencies<double>(cfg_.rope, cfg_.head_dim);
  I.rope_scale = cpu::rope_attention_factor(cfg_.rope);
  I.inv_freq = DeviceArray<double>(inv_freq.size());
  DFLASH_CUDA_CHECK(cudaMemcpy(I.inv_freq.data(), inv_freq.data(), inv_freq.size() * 8, cudaMemcpyHostToDevice));
}

DrafterGpu::DrafterGpu(const DrafterConfig& cfg, int64_t V, uint64_t seed, cudaStream_t stream)
    : impl_(new Impl(stream)), cfg_(cfg) {
  cfg.validate("DrafterGpu");
  if (cfg.head_dim != 64 && cfg.head_dim != 128)
    throw std::invalid_argument("DrafterGpu: head_dim " + std::to_string(cfg.head_dim) + " (GPU training needs 64 or 128)");
  if (V <= cfg.mask_token_id) throw std::invalid_argument("DrafterGpu: vocabulary smaller than mask_token_id");
  allocate(V);
  Impl& I = *impl_;
  uint64_t k = 0;
  for (const auto& [name, shape] : I.shapes) {
    const int64_t n = BasicTensor<float>::numel_of(shape);
    float* p = I.master.data() + I.offset[name];
    if (shape.size() == 1) cuda::fill_normal(p, n, 0, 1.f, 0.f, stream);
    else cuda::fill_normal(p, n, seed * 1000003 + ++k, 0.f, 0.02f, stream);
  }
  cuda::f32_to_bf16(I.master.data(), I.wb.data(), I.n, stream);
  I.embed = DeviceArray<bf16>(size_t(V * cfg.hidden_size));
  I.lm_head = DeviceArray<bf16>(size_t(V * cfg.hidden_size));
  cuda::fill_normal(I.embed.data(), V * cfg.hidden_size, seed * 1000003 + ++k, 0.f, 0.02f, stream);
  cuda::fill_normal(I.lm_head.data(), V * cfg.hidden_size, seed * 1000003 + ++k, 0.f, 0.02f, stream);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
}

DrafterGpu::~DrafterGpu() = default;

int64_t DrafterGpu::num_params() const { return impl_->n; }
float* DrafterGpu::grad_data() { return impl_->grad_buffer(); }
cudaStream_t DrafterGpu::stream() const { return impl_->s; }
cuda::GemmContext& DrafterGpu::gemm() { return impl_->gemm; }

// (No memset here: the next backward overwrites every gradient, see Impl::grad_zero_pending.)
void DrafterGpu::zero_grads() { impl_->grad_zero_pending = true; }

namespace {
template <typename T>
DrafterWeights<float> download(const DrafterConfig& cfg, const DeviceArray<T>& flat, cudaStream_t s) {
  const std::vector<T> h = flat.to_host(s);
  DrafterWeights<float> w = drafter_zeros<float>(cfg);
  size_t off = 0;
  for (auto& [name, t] : w.named()) {
    std::copy(h.begin() + long(off), h.begin() + long(off + t->data.size()), t->data.begin());
    off += t->data.size();
  }
  return w;
}
}  // namespace

DrafterWeights<float> DrafterGpu::weights() const { return download(cfg_, impl_->master, impl_->s); }
DrafterWeights<float> DrafterGpu::grads() const {
  return impl_->grad_zero_pending ? drafter_zeros<float>(cfg_) : download(cfg_, impl_->grad, impl_->s);
}

namespace {
std::vector<std::vector<float>> split(const std::vector<float>& flat, const DrafterConfig& cfg) {
  std::vector<std::vector<float>> r;
  size_t off = 0;
  for (const auto& [name, shape] : drafter_param_shapes(cfg)) {
    const size_t n = size_t(BasicTensor<float>::numel_of(shape));
    r.emplace_back(flat.begin() + long(off), flat.begin() + long(off + n));
    off += n;
  }
  return r;
}
}  // namespace

void DrafterGpu::moments(std::vector<std::vector<float>>* m, std::vector<std::vector<float>>* v) const {
  if (m) *m = split(impl_->m.to_host(impl_->s), cfg_);
  if (v) *v = split(impl_->v.to_host(impl_->s), cfg_);
}

void DrafterGpu::set_state(const DrafterWeights<float>& w, const std::vector<std::vector<float>>& m,
                           const std::vector<std::vector<float>>& v) {
  Impl& I = *impl_;
  const auto named = w.named();
  if (named.size() != m.size() || named.size() != v.size()) throw std::invalid_argument("DrafterGpu::set_state: tensor count");
  std::vector<float> fw, fm, fv;
  for (size_t i = 0; i < named.size(); ++i) {
    if (m[i].size() != named[i].second->data.size() || v[i].size() != m[i].size())
      throw std::invalid_argument("DrafterGpu::set_state: size of " + named[i].first);
    fw.insert(fw.end(), named[i].second->data.begin(), named[i].second->data.end());
    fm.insert(fm.end(), m[i].begin(), m[i].end());
    fv.insert(fv.end(), v[i].begin(), v[i].end());
  }
  if (int64_t(fw.size()) != I.n) throw std::invalid_argument("DrafterGpu::set_state: parameter count");
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(I.master.data(), fw.data(), fw.size() * 4, cudaMemcpyHostToDevice, I.s));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(I.m.data(), fm.data(), fm.size() * 4, cudaMemcpyHostToDevice, I.s));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(I.v.data(), fv.data(), fv.size() * 4, cudaMemcpyHostToDevice, I.s));
  cuda::f32_to_bf16(I.master.data(), I.wb.data(), I.n, I.s);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(I.s));
}

void DrafterGpu::scale_grads(float f) { cuda::scale_inplace(impl_->grad_buffer(), f, impl_->n, impl_->s); }

ClipResult DrafterGpu::optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) {
  Impl& I = *impl_;
  float* grad = I.grad_buffer();
  cuda::grad_sumsq(grad, I.n, I.sumsq.data(), I.sumsq_ws.data(), I.s);
  cuda::clip_coefficient(I.sumsq.data(), max_norm, I.norm.data(), I.coef.data(), I.s);
  ClipResult r;
  r.norm = I.norm.to_host(I.s)[0];
  if (!std::isfinite(r.norm)) {
    r.coef = std::nan("");
    return r;
  }
  r.coef = double(I.coef.to_host(I.s)[0]);
  cuda::adamw_update(I.master.data(), grad, I.m.data(), I.v.data(), I.wb.data(), I.n,
                     cuda::adamw_scalars(lr, o.beta1, o.beta2, o.eps, o.weight_decay, t), I.coef.data(), I.s);
  return r;
}

DrafterGpuStepResult DrafterGpu::step(const DrafterGpuSequence& seq, const DrafterGpuStepOptions& opt) {
  Impl& I = *impl_;
  cudaStream_t s = I.s;
  const DrafterConfig& c = cfg_;
  const int64_t d = c.hidden_size, hd = c.head_dim, H = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t K = int64_t(c.target_layer_ids.size()), B = c.block_size, L = c.num_hidden_layers;
  const int64_t S = int64_t(seq.ids.size()), N = seq.num_blocks, Q = N * B, SQ = S + Q, Im = c.intermediate_size;
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
  const bool compact = Qc > 0;          // the last layer's post-attention rows are the Qc used ones
  const int64_t Qf = compact ? Qc : Q;  // rows of the last layer's output and of the final norm
  auto d_used = upload(used, s);

  auto d_ids = upload(lay.block_ids, s);
  auto d_pq = upload(lay.pos_q, s), d_pkv = upload(lay.pos_kv, s);
  // One mask per distinct (window, causal) of the layers, uploaded once.
  std::map<std::pair<int64_t, bool>, StreamBuffer<cuda::KvRange32>> masks;
  for (int64_t i = 0; i < L; ++i) {
    const std::pair key{c.layer_window(i), c.layer_causal(i)};
    if (!masks.count(key))
      masks.emplace(key, upload(cuda::to_kv_range32(cpu::dflash_kv_ranges(seq.anchors, N, B, S, key.first, key.second)), s));
  }
  StreamBuffer<float> cq(size_t(Q * hd / 2), s), sq(size_t(Q * hd / 2), s), ckv(size_t(SQ * hd / 2), s),
      skv(size_t(SQ * hd / 2), s);
  cuda::rope_table(d_pq.data(), I.inv_freq.data(), Q, hd, cq.data(), sq.data(), s, I.rope_scale);
  cuda::rope_table(d_pkv.data(), I.inv_freq.data(), SQ, hd, ckv.data(), skv.data(), s, I.rope_scale);
  const float scale = float(1.0 / std::sqrt(double(hd)));
  auto layer_ranges = [&](int64_t i) { return masks.at({c.layer_window(i), c.layer_causal(i)}).data(); };
  auto linear = [&](const bf16* x, int64_t rows, int64_t in, int64_t out, int64_t w, bf16* y, float beta) {
    I.gemm.gemm({rows, out, in, false, true}, x, I.W(w), y, 1.f, beta);
  };

  StageTimer timer(s, opt.time_stages);
  // ---- forward ----
  timer.begin("forward");
  StreamBuffer<bf16> fc_out(size_t(S * d), s), ctx(size_t(S * d), s);
  StreamBuffer<float> inv_ctx(size_t(S), s);
  linear(seq.taps, S, K * d, d, I.p.fc, fc_out.data(), 0.f);
  cuda::rms_norm_forward(fc_out.data(), I.F(I.p.hidden_norm), ctx.data(), inv_ctx.data(), S, d, c.rms_norm_eps,
                         false, s);
  StreamBuffer<bf16> x(size_t(Q * d), s);
  StreamBuffer<int> bad(2, s);  // [mask token outside the embedding, non-finite taps]
  DFLASH_CUDA_CHECK(cudaMemsetAsync(bad.data(), 0, 2 * sizeof(int), s));
  cuda::flag_nonfinite(seq.taps, S * K * d, bad.data() + 1, s);
  if (seq.target_hidden) cuda::flag_nonfinite(seq.target_hidden, S * d, bad.data() + 1, s);  // (DSpark)
  cuda::embedding_gather(I.embed.data(), I.V, d, d_ids.data(), Q, x.data(), bad.data(), s);
  // One draft layer's forward from a.x_in: fills every saved activation of `a`, returns the output.
  auto forward_layer = [&](int64_t i, Saved& a) {
    const SavedSizes sz = z.saved(i);
    a.kv_in = StreamBuffer<bf16>(size_t(sz.kv_in), s);  // [ctx ; input_layernorm(x)]
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(a.kv_in.data(), ctx.data(), size_t(S * d) * 2, cudaMemcpyDeviceToDevice, s));
    bf16* hn = a.kv_in.data() + S * d;
    a.inv_in = StreamBuffer<float>(size_t(sz.inv_in), s);
    cuda::rms_norm_forward(a.x_in.data(), I.F(I.p.layer(i).input_layernorm), hn, a.inv_in.data(), Q, d,
                           c.rms_norm_eps, false, s);
    a.q_pre = StreamBuffer<bf16>(size_t(sz.q_pre), s);
    a.q_rot = StreamBuffer<bf16>(size_t(sz.q_rot), s);
    a.q_inv = StreamBuffer<float>(size_t(sz.q_inv), s);
    linear(hn, Q, d, H * hd, I.p.layer(i).q_proj, a.q_pre.data(), 0.f);
    cuda::rms_norm_forward(a.q_pre.data(), I.F(I.p.layer(i).q_norm), a.q_rot.data(), a.q_inv.data(),
                           Q * H, hd, c.rms_norm_eps, false, s);
    cuda::rope_apply(a.q_rot.data(), Q, H, hd, hd, cq.data(), sq.data(), false, s);
    a.k_pre = StreamBuffer<bf16>(size_t(sz.k_pre), s);
    a.k_rot = StreamBuffer<bf16>(size_t(sz.k_rot), s);
    a.k_inv = StreamBuffer<float>(size_t(sz.k_inv), s);
    a.v = StreamBuffer<bf16>(size_t(sz.v), s);
    linear(a.kv_in.data(), SQ, d, Hkv * hd, I.p.layer(i).k_proj, a.k_pre.data(), 0.f);
    cuda::rms_norm_forward(a.k_pre.data(), I.F(I.p.layer(i).k_norm), a.k_rot.data(), a.k_inv.data(),
                           SQ * Hkv, hd, c.rms_norm_eps, false, s);
    cuda::rope_apply(a.k_rot.data(), SQ, Hkv, hd, hd, ckv.data(), skv.data(), false, s);
    linear(a.kv_in.data(), SQ, d, Hkv * hd, I.p.layer(i).v_proj, a.v.data(), 0.f);
    a.o = StreamBuffer<bf16>(size_t(sz.o), s);
    a.lse = StreamBuffer<float>(size_t(sz.lse), s);
    timer.begin("attention_fwd");
    cuda::masked_attention_forward(a.q_rot.data(), a.k_rot.data(), a.v.data(), layer_ranges(i), Q, SQ, int(H),
                                   int(Hkv), int(hd), scale, a.o.data(), a.lse.data(), s);
    timer.end("attention_fwd");
    // Rows on from here: all Q, or in the last layer the Qp = Qc rows with a loss weight.
    const bool rows = compact && i == L - 1;
    const int64_t Qp = rows ? Qc : Q;
    a.x_mid = StreamBuffer<bf16>(size_t(sz.x_mid), s);  // x_in + o_proj(o)
    if (rows) {
      a.o_rows = StreamBuffer<bf16>(size_t(sz.o_rows), s);
      cuda::embedding_gather(a.o.data(), Q, H * hd, d_used.data(), Qc, a.o_rows.data(), nullptr, s);
      cuda::embedding_gather(a.x_in.data(), Q, d, d_used.data(), Qc, a.x_mid.data(), nullptr, s);
    } else {
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(a.x_mid.data(), a.x_in.data(), size_t(Q * d) * 2, cudaMemcpyDeviceToDevice, s));
    }
    linear(rows ? a.o_rows.data() : a.o.data(), Qp, H * hd, d, I.p.layer(i).o_proj, a.x_mid.data(), 1.f);
    a.hp = StreamBuffer<bf16>(size_t(sz.hp), s);
    a.inv_post = StreamBuffer<float>(size_t(sz.inv_post), s);
    cuda::rms_norm_forward(a.x_mid.data(), I.F(I.p.layer(i).post_attention_layernorm), a.hp.data(),
                           a.inv_post.data(), Qp, d, c.rms_norm_eps, false, s);
    a.gu = StreamBuffer<bf16>(size_t(sz.gu), s);
    a.act = StreamBuffer<bf16>(size_t(sz.act), s);
    linear(a.hp.data(), Qp, d, 2 * Im, I.p.layer(i).gate_up, a.gu.data(), 0.f);
    cuda::swiglu_forward(a.gu.data(), Qp, Im, a.act.data(), s);
    StreamBuffer<bf16> out(size_t(sz.out), s);  // x_mid + down_proj(act)
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(out.data(), a.x_mid.data(), size_t(Qp * d) * 2, cudaMemcpyDeviceToDevice, s));
    linear(a.act.data(), Qp, Im, d, I.p.layer(i).down_proj, out.data(), 1.f);
    return out;
  };
  std::vector<Saved> sv(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    Saved& a = sv[size_t(i)];
    a.x_in = std::move(x);
    x = forward_layer(i, a);
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
  std::map<int64_t, int> wgrads;  // calls per weight (by offset): each must be written exactly once
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
      wgrads[w] += backward;
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
  const BackwardSizes bz = z.backward();
  StreamBuffer<bf16> dx(size_t(bz.dx), s), tmp(size_t(bz.tmp), s);
  StreamBuffer<float> nws(size_t(bz.nws), s);
  cuda::rms_norm_backward(x.data(), I.F(I.p.norm), inv_final.data(), dhf.data(), dx.data(), I.G(I.p.norm),
                          nws.data(), Qf, d, false, s);  // dx's first Qc rows
  StreamBuffer<float> dctx(size_t(bz.dctx), s);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(dctx.data(), 0, size_t(S * d) * 4, s));
  // dW += dy^T x (= after zero_grads) over `rows` rows: dy [rows, out], x [rows, in] -> [out, in]
  auto wgrad = [&](const bf16* dy, const bf16* xin, int64_t rows, int64_t out, int64_t in, int64_t w) {
    ++wgrads[w];
    I.gemm.gemm({out, in, rows, true, false}, dy, xin, I.G(w), 1.f, grad_beta);
  };
  auto wgrad_gate_up = [&](const bf16* dgu, const bf16* xin, int64_t rows, int64_t i) {  // gate_proj and up_proj
    ++wgrads[I.p.layer(i).up_proj];
    wgrad(dgu, xin, rows, 2 * Im, d, I.p.layer(i).gate_up);
  };
  // dx (=|+=) dy W: dy [rows, out], W [out, in]
  auto dgrad = [&](const bf16* dy, int64_t rows, int64_t out, int64_t in, int64_t w, auto* dxp, float beta) {
    I.gemm.gemm({rows, in, out, false, false}, dy, I.W(w), dxp, 1.f, beta);
  };
  StreamBuffer<bf16> dact(size_t(bz.dact), s), dhp(size_t(bz.dhp), s), dof(size_t(bz.dof), s), dq(size_t(bz.dq), s),
      dk(size_t(bz.dk), s), dv(size_t(bz.dv), s), dhn(size_t(bz.dhn), s);
  StreamBuffer<char> aws(size_t(bz.attention_ws_bytes), s);
  for (int64_t i = L - 1; i >= 0; --i) {
    Saved& a = sv[size_t(i)];
    if (opt.recompute) forward_layer(i, a);  // the same kernels on the same input: bitwise the same activations
    const bf16* hn = a.kv_in.data() + S * d;
    const bool rows = compact && i == L - 1;  // the post-attention part on the Qc rows with a loss weight
    const int64_t Qp = rows ? Qc : Q;
    // MLP: x_out = x_mid + down(silu(gate(hp)) * up(hp))
    dgrad(dx.data(), Qp, d, Im, I.p.layer(i).down_proj, dact.data(), 0.f);
    wgrad(dx.data(), a.act.data(), Qp, d, Im, I.p.layer(i).down_proj);
    cuda::swiglu_backward(a.gu.data(), dact.data(), Qp, Im, s);  // in place: gu becomes dgate | dup
    dgrad(a.gu.data(), Qp, 2 * Im, d, I.p.layer(i).gate_up, dhp.data(), 0.f);
    wgrad_gate_up(a.gu.data(), a.hp.data(), Qp, i);
    cuda::rms_norm_backward(a.x_mid.data(), I.F(I.p.layer(i).post_attention_layernorm), a.inv_post.data(),
                            dhp.data(), tmp.data(), I.G(I.p.layer(i).post_attention_layernorm), nws.data(), Qp, d,
                            false, s);
    cuda::add_inplace(dx.data(), tmp.data(), Qp * d, s);  // d loss / d x_mid
    // attention: x_mid = x_in + o_proj(attn(q, k, v))
    if (rows) {  // back to all Q rows: the others' gradients are zero
      dgrad(dx.data(), Qc, d, H * hd, I.p.layer(i).o_proj, dq.data(), 0.f);  // [Qc, H*hd]
      wgrad(dx.data(), a.o_rows.data(), Qc, d, H * hd, I.p.layer(i).o_proj);
      DFLASH_CUDA_CHECK(cudaMemsetAsync(dof.data(), 0, size_t(Q * H * hd) * 2, s));
      cuda::scatter_rows(dq.data(), Qc, H * hd, d_used.data(), dof.data(), s);
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(tmp.data(), dx.data(), size_t(Qc * d) * 2, cudaMemcpyDeviceToDevice, s));
      DFLASH_CUDA_CHECK(cudaMemsetAsync(dx.data(), 0, size_t(Q * d) * 2, s));
      cuda::scatter_rows(tmp.data(), Qc, d, d_used.data(), dx.data(), s);
    } else {
      dgrad(dx.data(), Q, d, H * hd, I.p.layer(i).o_proj, dof.data(), 0.f);
      wgrad(dx.data(), a.o.data(), Q, d, H * hd, I.p.layer(i).o_proj);
    }
    timer.begin("attention_bwd");
    cuda::masked_attention_backward(a.q_rot.data(), a.k_rot.data(), a.v.data(), a.o.data(), a.lse.data(), dof.data(),
                                    layer_ranges(i), Q, SQ, int(H), int(Hkv), int(hd), scale, dq.data(), dk.data(),
                                    dv.data(), aws.data(), s);
    timer.end("attention_bwd");
    cuda::rope_apply(dq.data(), Q, H, hd, hd, cq.data(), sq.data(), true, s);
    cuda::rope_apply(dk.data(), SQ, Hkv, hd, hd, ckv.data(), skv.data(), true, s);
    cuda::rms_norm_backward(a.q_pre.data(), I.F(I.p.layer(i).q_norm), a.q_inv.data(), dq.data(),
                            dq.data(), I.G(I.p.layer(i).q_norm), nws.data(), Q * H, hd, false, s);
    cuda::rms_norm_backward(a.k_pre.data(), I.F(I.p.layer(i).k_norm), a.k_inv.data(), dk.data(),
                            dk.data(), I.G(I.p.layer(i).k_norm), nws.data(), SQ * Hkv, hd, false, s);
    const int64_t wq = I.p.layer(i).q_proj, wk = I.p.layer(i).k_proj,
                      wv = I.p.layer(i).v_proj;
    wgrad(dq.data(), hn, Q, H * hd, d, wq);
    wgrad(dk.data(), a.kv_in.data(), SQ, Hkv * hd, d, wk);
    wgrad(dv.data(), a.kv_in.data(), SQ, Hkv * hd, d, wv);
    dgrad(dq.data(), Q, H * hd, d, wq, dhn.data(), 0.f);
    dgrad(dk.data() + S * Hkv * hd, Q, Hkv * hd, d, wk, dhn.data(), 1.f);
    dgrad(dv.data() + S * Hkv * hd, Q, Hkv * hd, d, wv, dhn.data(), 1.f);
    dgrad(dk.data(), S, Hkv * hd, d, wk, dctx.data(), 1.f);
    dgrad(dv.data(), S, Hkv * hd, d, wv, dctx.data(), 1.f);
    cuda::rms_norm_backward(a.x_in.data(), I.F(I.p.layer(i).input_layernorm), a.inv_in.data(), dhn.data(),
                            tmp.data(), I.G(I.p.layer(i).input_layernorm), nws.data(), Q, d, false, s);
    cuda::add_inplace(dx.data(), tmp.data(), Q * d, s);  // d loss / d x_in (dropped after layer 0: embeddings are frozen)
    sv[size_t(i)] = Saved();                              // free this layer's activations
  }
  StreamBuffer<bf16> dctx_b(size_t(S * d), s), dfc(size_t(S * d), s);
  cuda::f32_to_bf16(dctx.data(), dctx_b.data(), S * d, s);
  cuda::rms_norm_backward(fc_out.data(), I.F(I.p.hidden_norm), inv_ctx.data(), dctx_b.data(), dfc.data(),
                          I.G(I.p.hidden_norm), nws.data(), S, d, false, s);
  wgrad(dfc.data(), seq.taps, S, d, K * d, I.p.fc);
  for (const auto& [name, shape] : I.shapes)
    if (shape.size() == 2 && wgrads[I.offset.at(name)] != 1)
      throw std::logic_error("DrafterGpu::step: the gradient of " + name + " was written " +
                             std::to_string(wgrads[I.offset.at(name)]) + " times, not once");
  I.grad_zero_pending = false;
  timer.end("backward");
  if (opt.time_stages) {
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
    res.stage_ms = timer.totals();
  }
  return res;
}

}  // namespace dflash
