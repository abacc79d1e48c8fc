// The drafter's parameters on the GPU: fp32 master weights, gradients, AdamW moments and the bf16
// copy the products read, flat, with their offsets; the optimizer step. The training step itself is
// in drafter_gpu_step.cpp, drafting in drafter_gpu_draft.cpp.
#include "models/cuda/drafter_gpu.h"

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/cuda/drafter_gpu_impl.h"
#include "ops/cuda/adamw.h"
#include "ops/cuda/elementwise.h"
#include "ops/rope.h"
#include "tensor/dtype.h"

namespace dflash {

using cuda::bf16;
using cuda::DeviceArray;

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

}  // namespace dflash
