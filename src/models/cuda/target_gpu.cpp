// The target on the GPU: its weights (bf16 or E4M3 projections), the decoding cache and its rollback,
// the forward's entry points, the final norm and the LM head. The layers themselves run in
// target_gpu_layers.cpp.
#include "models/cuda/target_gpu.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <stdexcept>
#include <tuple>

#include "models/cuda/target_gpu_impl.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/norm.h"
#include "ops/rope.h"
#include "tensor/dtype.h"

namespace dflash {

using cuda::bf16;
using cuda::DeviceArray;
using cuda::StreamBuffer;

namespace {


/// The tensors, concatenated in order, as one bf16 device array.
DeviceArray<bf16> to_bf16(const std::vector<const Tensor*>& ts, cudaStream_t s) {
  std::vector<uint16_t> h;
  for (const Tensor* t : ts)
    for (float v : t->data) h.push_back(f32_to_bf16(v));
  DeviceArray<bf16> d(h.size());
  if (!h.empty()) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(d.data(), h.data(), h.size() * 2, cudaMemcpyHostToDevice, s));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return d;
}
DeviceArray<bf16> to_bf16(const Tensor& t, cudaStream_t s) { return to_bf16(std::vector<const Tensor*>{&t}, s); }

/// Rows [first, first + block) of every `period` rows of a 2-D tensor, as one bf16 device array: the
/// query (first 0) or the output gate (first Dh) rows of a gated q_proj [H * 2 Dh, D] (period 2 Dh).
/// Throws std::invalid_argument when the rows are not a whole number of periods.
DeviceArray<bf16> rows_to_bf16(const Tensor& t, int64_t period, int64_t first, int64_t block, cudaStream_t s) {
  if (t.ndim() != 2 || t.dim(0) % period != 0 || first + block > period)
    throw std::invalid_argument("TargetGpu: q_proj " + shape_str(t.shape) + " is not whole blocks of " +
                                std::to_string(period) + " rows (query and output gate per head)");
  const int64_t cols = t.dim(1);
  Tensor r({t.dim(0) / period * block, cols});
  for (int64_t i = 0; i < t.dim(0) / period; ++i)
    std::copy_n(t.data.begin() + (i * period + first) * cols, block * cols, r.data.begin() + i * block * cols);
  return to_bf16(r, s);
}


/// Elements of one layer's device arrays (LayerGpu) as both constructors allocate them: matrices
/// (the projections bf16 or E4M3, LinearGpu; the experts bf16), fp32 vectors. Zero for what the layer
/// has not. linear_rows: the output channels of the projections (their scales under kFp8).
struct LayerSizes {
  int64_t q = 0, q_gate = 0, k = 0, v = 0, o = 0, gate_up = 0, down = 0, in_proj = 0, out = 0;  // LinearGpu
  int64_t router = 0, experts_gate_up = 0, experts_down = 0, shared_gate_up = 0, shared_down = 0;  // bf16
  int64_t q_norm = 0, k_norm = 0, in_ln = 0, post_ln = 0, conv = 0, A_log = 0, dt_bias = 0, gnorm = 0;  // f32
  int64_t linear_rows = 0;
  int64_t bytes(TargetDtype dtype) const {
    const int64_t linear = q + q_gate + k + v + o + gate_up + down + in_proj + out;
    const int64_t linear_bytes = dtype == TargetDtype::kFp8 ? linear + 4 * linear_rows : 2 * linear;
    return linear_bytes + 2 * (router + experts_gate_up + experts_down + shared_gate_up + shared_down) +
           4 * (q_norm + k_norm + in_ln + post_ln + conv + A_log + dt_bias + gnorm);
  }
};

LayerSizes layer_sizes(const ModelSpec& sp, int64_t i) {
  const int64_t D = sp.hidden_size, H = sp.num_attention_heads, Hkv = sp.num_key_value_heads, Dh = sp.head_dim;
  const int64_t Hk = sp.linear_num_key_heads, Hv = sp.linear_num_value_heads, dk = sp.linear_key_head_dim;
  const int64_t dv = sp.linear_value_head_dim, C = 2 * Hk * dk + Hv * dv;
  LayerSizes z;
  if (sp.layer_types[size_t(i)] == LayerKind::GatedDeltaNet) {
    z.in_proj = (C + Hv * dv + 2 * Hv) * D, z.out = D * Hv * dv;
    z.conv = C * sp.linear_conv_kernel_dim, z.A_log = Hv, z.dt_bias = Hv, z.gnorm = dv;
    z.linear_rows = C + Hv * dv + 2 * Hv + D;
  } else {
    z.q = H * Dh * D, z.k = Hkv * Dh * D, z.v = Hkv * Dh * D, z.o = D * H * Dh;
    if (sp.attn_output_gate()) z.q_gate = H * Dh * D;
    if (sp.has_qk_norm()) z.q_norm = Dh, z.k_norm = Dh;
    z.linear_rows = (sp.attn_output_gate() ? 2 : 1) * H * Dh + 2 * Hkv * Dh + D;
  }
  if (sp.is_moe_layer(i)) {
    const int64_t E = sp.num_experts, Em = sp.moe_intermediate_size, Es = sp.shared_expert_intermediate_size;
    z.router = (E + (Es > 0 ? 1 : 0)) * D, z.experts_gate_up = E * 2 * Em * D, z.experts_down = E * D * Em;
    if (Es > 0) z.shared_gate_up = 2 * Es * D, z.shared_down = D * Es;
  } else {
    z.gate_up = 2 * sp.intermediate_size * D, z.down = D * sp.intermediate_size;
    z.linear_rows += 2 * sp.intermediate_size + D;
  }
  z.in_ln = D, z.post_ln = D;
  return z;
}

/// Throws std::logic_error when an uploaded layer's arrays differ from layer_sizes (the memory plan's).
void check_layer_sizes(const LayerGpu& g, const LayerSizes& z, int64_t i) {
  const std::tuple<const char*, size_t, int64_t> arrays[] = {
      {"q_proj", g.q.size(), z.q}, {"q_proj (gate)", g.q_gate.size(), z.q_gate}, {"k_proj", g.k.size(), z.k},
      {"v_proj", g.v.size(), z.v}, {"o_proj", g.o.size(), z.o}, {"gate_up_proj", g.gate_up.size(), z.gate_up},
      {"down_proj", g.down.size(), z.down}, {"in_proj", g.in_proj.size(), z.in_proj}, {"out_proj", g.out.size(), z.out},
      {"router", g.router.size(), z.router}, {"experts.gate_up_proj", g.experts_gate_up.size(), z.experts_gate_up},
      {"experts.down_proj", g.experts_down.size(), z.experts_down},
      {"shared_expert.gate_up_proj", g.shared_gate_up.size(), z.shared_gate_up},
      {"shared_expert.down_proj", g.shared_down.size(), z.shared_down}, {"q_norm", g.q_norm.size(), z.q_norm},
      {"k_norm", g.k_norm.size(), z.k_norm}, {"input_layernorm", g.in_ln.size(), z.in_ln},
      {"post_attention_layernorm", g.post_ln.size(), z.post_ln}, {"conv1d", g.conv.size(), z.conv},
      {"A_log", g.A_log.size(), z.A_log}, {"dt_bias", g.dt_bias.size(), z.dt_bias}, {"norm", g.gnorm.size(), z.gnorm}};
  for (const auto& [name, held, size] : arrays)
    if (int64_t(held) != size)
      throw std::logic_error("TargetGpu: layer " + std::to_string(i) + "'s " + name + " holds " + std::to_string(held) +
                             " elements, its size is " + std::to_string(size));
}

std::vector<float> host_f32(const StreamBuffer<bf16>& b, int64_t n, cudaStream_t s) {
  std::vector<uint16_t> h(static_cast<size_t>(n));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(h.data(), b.data(), size_t(n) * 2, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> r(h.size());
  for (size_t i = 0; i < h.size(); ++i) r[i] = bf16_to_f32(h[i]);
  return r;
}

void require_gpu_support(const ModelSpec& s, TargetDtype dtype) {
  const std::string why = gpu_unsupported_reason(s);
  if (!why.empty()) throw std::invalid_argument("this model cannot run with --device cuda: " + why);
  if (dtype != TargetDtype::kFp8) return;
  const std::string no_fp8 = cuda::fp8_unsupported_reason();
  if (!no_fp8.empty()) throw std::invalid_argument("--target-dtype fp8 cannot run on this GPU: " + no_fp8);
  // cuBLASLt's FP8 rules: every product's input size (K) a multiple of 16, its output rows 16-byte
  // aligned (N a multiple of 8 for bf16 outputs).
  const int64_t D = s.hidden_size, HDh = s.num_attention_heads * s.head_dim, HkvDh = s.num_key_value_heads * s.head_dim;
  const int64_t HvDv = s.linear_num_value_heads * s.linear_value_head_dim;
  const int64_t Nin = 2 * s.linear_num_key_heads * s.linear_key_head_dim + 2 * HvDv + 2 * s.linear_num_value_heads;
  bool dense_mlp = false, gdn = false;
  for (int64_t i = 0; i < s.num_hidden_layers; ++i) {
    dense_mlp = dense_mlp || !s.is_moe_layer(i);
    gdn = gdn || s.layer_types[size_t(i)] == LayerKind::GatedDeltaNet;
  }
  std::string bad;
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) bad += (bad.empty() ? "" : ", ") + what;
  };
  need(D % 16 == 0, "hidden_size " + std::to_string(D) + " is not a multiple of 16");
  need(HDh % 16 == 0, "heads x head_dim " + std::to_string(HDh) + " is not a multiple of 16");
  need(HkvDh % 8 == 0, "kv heads x head_dim " + std::to_string(HkvDh) + " is not a multiple of 8");
  if (dense_mlp) need(s.intermediate_size % 16 == 0, "intermediate_size " + std::to_string(s.intermediate_size) + " is not a multiple of 16");
  if (gdn) {
    need(HvDv % 16 == 0, "GatedDeltaNet values " + std::to_string(HvDv) + " is not a multiple of 16");
    need(Nin % 8 == 0, "GatedDeltaNet in_proj rows " + std::to_string(Nin) + " is not a multiple of 8");
  }
  if (!bad.empty())
    throw std::invalid_argument("--target-dtype fp8 cannot run this model: " + bad +
                                " (cuBLASLt's FP8 products take input sizes that are multiples of 16 and output "
                                "rows of whole 16 bytes)");
}
}  // namespace

TargetGpu::TargetGpu(const TargetModel& m, cudaStream_t stream, TargetDtype dtype)
    : impl_(new Impl(stream, dtype)), spec_(m.spec()) {
  require_gpu_support(spec_, dtype);
  Impl& I = *impl_;
  const int64_t D = spec_.hidden_size;
  auto linear = [&](DeviceArray<bf16> w, int64_t in_features) {
    const int64_t rows = int64_t(w.size()) / in_features;
    return LinearGpu::of(std::move(w), rows, dtype, stream);
  };
  for (const LayerWeights& l : m.layers()) {
    LayerGpu g;
    g.kind = l.kind;
    if (l.kind == LayerKind::GatedDeltaNet) {
      const GatedDeltaNetWeights& w = l.gdn;
      g.in_proj = linear(to_bf16({&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a}, stream), D);
      g.out = linear(to_bf16(w.out_proj, stream), w.out_proj.dim(1));
      g.conv = DeviceArray<float>(w.conv1d.data, stream), g.A_log = DeviceArray<float>(w.A_log.data, stream);
      g.dt_bias = DeviceArray<float>(w.dt_bias.data, stream), g.gnorm = DeviceArray<float>(w.norm.data, stream);
    } else {
      if (spec_.attn_output_gate()) {  // q_proj holds per head the query, then the output gate: two matrices
        const int64_t Dh = spec_.head_dim;
        g.q = linear(rows_to_bf16(l.attn.q_proj, 2 * Dh, 0, Dh, stream), D);
        g.q_gate = linear(rows_to_bf16(l.attn.q_proj, 2 * Dh, Dh, Dh, stream), D);
      } else {
        g.q = linear(to_bf16(l.attn.q_proj, stream), D);
      }
      g.k = linear(to_bf16(l.attn.k_proj, stream), D), g.v = linear(to_bf16(l.attn.v_proj, stream), D);
      g.o = linear(to_bf16(l.attn.o_proj, stream), l.attn.o_proj.dim(1));
      if (spec_.has_qk_norm()) {
        g.q_norm = DeviceArray<float>(l.attn.q_norm.data, stream);
        g.k_norm = DeviceArray<float>(l.attn.k_norm.data, stream);
      }
    }
    g.moe = l.moe_layer;
    if (g.moe) {
      const MoeWeights& w = l.moe;
      std::vector<const Tensor*> router{&w.router}, gate_up, down;
      if (spec_.shared_expert_intermediate_size > 0) router.push_back(&w.shared_gate);
      for (const Tensor& t : w.gate_up) gate_up.push_back(&t);
      for (const Tensor& t : w.down) down.push_back(&t);
      g.router = to_bf16(router, stream), g.experts_gate_up = to_bf16(gate_up, stream);
      g.experts_down = to_bf16(down, stream);
      if (spec_.shared_expert_intermediate_size > 0) {
        g.shared_gate_up = to_bf16({&w.shared.gate_proj, &w.shared.up_proj}, stream);
        g.shared_down = to_bf16(w.shared.down_proj, stream);
      }
    } else {
      g.gate_up = linear(to_bf16({&l.mlp.gate_proj, &l.mlp.up_proj}, stream), D);
      g.down = linear(to_bf16(l.mlp.down_proj, stream), l.mlp.down_proj.dim(1));
    }
    g.in_ln = DeviceArray<float>(l.input_layernorm.data, stream);
    g.post_ln = DeviceArray<float>(l.post_attention_layernorm.data, stream);
    check_layer_sizes(g, layer_sizes(spec_, int64_t(I.layers.size())), int64_t(I.layers.size()));
    I.layers.push_back(std::move(g));
  }
  I.embed = to_bf16(m.embed_tokens(), stream);
  I.lm_head = to_bf16(m.lm_head(), stream);
  I.norm = DeviceArray<float>(m.final_norm().data, stream);
  I.inv_freq = DeviceArray<double>(std::vector<double>(m.inv_freq().begin(), m.inv_freq().end()), stream);
}

TargetGpu::TargetGpu(const ModelSpec& spec, uint64_t seed, cudaStream_t stream, TargetDtype dtype)
    : impl_(new Impl(stream, dtype)), spec_(spec) {
  spec_.validate("TargetGpu");
  require_gpu_support(spec_, dtype);
  Impl& I = *impl_;
  const int64_t D = spec_.hidden_size, V = spec_.vocab_size;
  uint64_t k = 0;
  auto matrix = [&](int64_t n) {  // bf16 ~ N(0, 0.02^2)
    DeviceArray<bf16> w(static_cast<size_t>(n));
    cuda::fill_normal(w.data(), n, seed * 1000003 + ++k, 0.f, 0.02f, stream);
    return w;
  };
  auto normal = [&](int64_t n, float mean, float std) {
    DeviceArray<float> w(static_cast<size_t>(n));
    cuda::fill_normal(w.data(), n, seed * 1000003 + ++k, mean, std, stream);
    return w;
  };
  auto linear = [&](int64_t n, int64_t in_features) { return LinearGpu::of(matrix(n), n / in_features, dtype, stream); };
  const int64_t HDh = spec_.num_attention_heads * spec_.head_dim;
  const int64_t HvDv = spec_.linear_num_value_heads * spec_.linear_value_head_dim;
  auto ones = [&](int64_t n) {
    DeviceArray<float> w(static_cast<size_t>(n));
    cuda::fill_normal(w.data(), n, 0, 1.f, 0.f, stream);
    return w;
  };
  for (int64_t i = 0; i < spec_.num_hidden_layers; ++i) {
    const LayerSizes z = layer_sizes(spec_, i);
    LayerGpu g;
    g.kind = spec_.layer_types[size_t(i)];
    if (g.kind == LayerKind::GatedDeltaNet) {
      // A_log ~ N(0, 0.5), dt_bias 0: decays exp(-exp(A_log) softplus(a)) spread around exp(-0.7).
      g.in_proj = linear(z.in_proj, D), g.out = linear(z.out, HvDv);
      g.conv = normal(z.conv, 0.f, 0.3f), g.A_log = normal(z.A_log, 0.f, 0.5f);
      g.dt_bias = normal(z.dt_bias, 0.f, 0.f), g.gnorm = ones(z.gnorm);
    } else {
      g.q = linear(z.q, D), g.k = linear(z.k, D), g.v = linear(z.v, D);
      if (z.q_gate) g.q_gate = linear(z.q_gate, D);
      g.o = linear(z.o, HDh);
      if (z.q_norm) g.q_norm = ones(z.q_norm), g.k_norm = ones(z.k_norm);
    }
    g.moe = spec_.is_moe_layer(i);
    if (g.moe) {
      g.router = matrix(z.router), g.experts_gate_up = matrix(z.experts_gate_up), g.experts_down = matrix(z.experts_down);
      if (z.shared_gate_up) g.shared_gate_up = matrix(z.shared_gate_up), g.shared_down = matrix(z.shared_down);
    } else {
      g.gate_up = linear(z.gate_up, D), g.down = linear(z.down, spec_.intermediate_size);
    }
    g.in_ln = ones(z.in_ln), g.post_ln = ones(z.post_ln);
    I.layers.push_back(std::move(g));
  }
  I.embed = matrix(V * D);
  if (spec_.tie_word_embeddings) {
    I.lm_head = DeviceArray<bf16>(I.embed.size());
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(I.lm_head.data(), I.embed.data(), I.embed.size() * 2, cudaMemcpyDeviceToDevice, stream));
  } else {
    I.lm_head = matrix(V * D);
  }
  I.norm = ones(D);
  const std::vector<float> inv_freq = cpu::rope_inv_freq(spec_.rope, spec_.rotary_dim());
  I.inv_freq = DeviceArray<double>(std::vector<double>(inv_freq.begin(), inv_freq.end()), stream);  // synchronizes
}

TargetGpu::~TargetGpu() = default;

int64_t TargetGpu::weight_bytes(const ModelSpec& spec, TargetDtype dtype) {
  int64_t b = 0;
  for (int64_t i = 0; i < spec.num_hidden_layers; ++i) b += layer_sizes(spec, i).bytes(dtype);
  return b + 2 * (2 * spec.vocab_size * spec.hidden_size) + 4 * spec.hidden_size + 8 * (spec.rotary_dim() / 2) +
         int64_t(kTargetGemmWorkspaceBytes);
}

void TargetGpu::reset_cache(int n_seq) {
  if (n_seq < 0) throw std::invalid_argument("reset_cache: negative number of sequences");
  Impl& I = *impl_;
  const ModelSpec& sp = spec_;
  I.cache = KvCache(n_seq, sp.num_hidden_layers, sp.num_key_value_heads * sp.head_dim);
  I.gdn.clear();
  I.gdn.resize(size_t(sp.num_hidden_layers));
  I.rollback_from.assign(size_t(n_seq), -1);
  I.rollback_cu.clear();
  I.replay.assign(size_t(n_seq), 0);
  const int64_t C = 2 * sp.linear_num_key_heads * sp.linear_key_head_dim + sp.linear_num_value_heads * sp.linear_value_head_dim;
  const int64_t state = sp.linear_num_value_heads * sp.linear_key_head_dim * sp.linear_value_head_dim;
  for (int64_t i = 0; i < sp.num_hidden_layers; ++i) {
    if (sp.layer_types[size_t(i)] != LayerKind::GatedDeltaNet) continue;
    Impl::GdnCache& g = I.gdn[size_t(i)];
    g.window = DeviceArray<float>(size_t(n_seq * (sp.linear_conv_kernel_dim - 1) * C));
    g.state = DeviceArray<float>(size_t(n_seq * state));
    g.window.fill_bytes(0, I.s);
    g.state.fill_bytes(0, I.s);
  }
}

void TargetGpu::truncate_cache(int s, int64_t length) {
  Impl& I = *impl_;
  KvCache& C = I.cache;
  if (s < 0 || s >= C.n)
    throw std::invalid_argument("truncate_cache: sequence " + std::to_string(s) + " of " + std::to_string(C.n));
  if (length < 0 || length > C.len[size_t(s)])
    throw std::invalid_argument("truncate_cache: length " + std::to_string(length) + " outside [0, " +
                                std::to_string(C.len[size_t(s)]) + "] (sequence " + std::to_string(s) + ")");
  if (length == C.len[size_t(s)]) return;
  const ModelSpec& sp = spec_;
  const int64_t K1 = sp.linear_conv_kernel_dim - 1;
  const int64_t Cg = 2 * sp.linear_num_key_heads * sp.linear_key_head_dim + sp.linear_num_value_heads * sp.linear_value_head_dim;
  const int64_t St = sp.linear_num_value_heads * sp.linear_key_head_dim * sp.linear_value_head_dim;
  const int64_t from = I.rollback_from[size_t(s)];
  if (length > 0 && has_gated_deltanet(sp) && from < 0)
    throw std::invalid_argument("truncate_cache: sequence " + std::to_string(s) + "'s last tokens came from a " +
                                "forward_cached without keep_rollback: its GatedDeltaNet states cannot go back to " +
                                std::to_string(length));
  if (length > 0 && has_gated_deltanet(sp) && length < from)
    throw std::invalid_argument("truncate_cache: GatedDeltaNet states of sequence " + std::to_string(s) +
                                " are kept only back to length " + std::to_string(from) + "; asked for " +
                                std::to_string(length));
  // history row of token j of the last forward: s * (K-1) + cu[s] + j; window after token j = rows j .. j + K-2
  const int64_t j = length - from, row0 = from >= 0 && !I.rollback_cu.empty() ? I.rollback_cu[size_t(s)] : 0;
  for (Impl::GdnCache& g : I.gdn) {
    if (!g.state.size()) continue;
    float* window = g.window.data() + s * K1 * Cg;
    float* state = g.state.data() + s * St;
    if (length == 0) {  // empty again
      if (K1 > 0) DFLASH_CUDA_CHECK(cudaMemsetAsync(window, 0, size_t(K1 * Cg) * 4, I.s));
      DFLASH_CUDA_CHECK(cudaMemsetAsync(state, 0, size_t(St) * 4, I.s));
      continue;
    }
    if (K1 > 0)
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(window, g.hist.data() + (s * K1 + row0 + j) * Cg, size_t(K1 * Cg) * 4,
                                        cudaMemcpyDeviceToDevice, I.s));
    // The state before that forward; its first j tokens run again before the state is next read
    // (replay_accepted: one launch per layer for every sequence rolled back).
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(state, g.state_before.data() + s * St, size_t(St) * 4, cudaMemcpyDeviceToDevice, I.s));
  }
  if (has_gated_deltanet(sp)) I.replay[size_t(s)] = length == 0 ? 0 : j;
  if (length == 0) I.rollback_from[size_t(s)] = -1;
  C.len[size_t(s)] = length;
}

int64_t TargetGpu::cached_length(int s) const { return impl_->cache.len.at(size_t(s)); }

void TargetGpu::replay_accepted() {
  Impl& I = *impl_;
  if (std::all_of(I.replay.begin(), I.replay.end(), [](int64_t n) { return n == 0; })) return;
  const ModelSpec& sp = spec_;
  const int64_t Hk = sp.linear_num_key_heads, Hv = sp.linear_num_value_heads, dk = sp.linear_key_head_dim;
  const int64_t dv = sp.linear_value_head_dim;
  // Every sequence's rows of that forward, the first replay[s] of them: the same kernel on the same
  // inputs from the same state gives the state the forward had after them.
  const GdnInputs in(I.rollback_cu.back(), Hk, Hv, dk, dv);
  StreamBuffer<float> o(size_t(in.nv), I.s);  // outputs of the replay (unused)
  for (Impl::GdnCache& g : I.gdn) {
    if (!g.state.size()) continue;
    const float* x = g.inputs.data();
    cuda::gated_delta_rule_recurrent(x + in.q, x + in.k, x + in.v, x + in.g, x + in.beta, I.rollback_cu, int(Hk),
                                     int(Hv), int(dk), int(dv), g.state.data(), nullptr, o.data(), I.s, I.replay);
  }
  std::fill(I.replay.begin(), I.replay.end(), 0);
}

ForwardOutput TargetGpu::forward_cached(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu,
                                        const ForwardOptions& opt, std::vector<int32_t>* argmax) {
  return forward_impl(ids, cu, opt, true, argmax);
}

ForwardOutput TargetGpu::forward(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu,
                                 const ForwardOptions& opt, std::vector<int32_t>* argmax) {
  return forward_impl(ids, cu, opt, false, argmax);
}

ForwardOutput TargetGpu::forward_impl(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu,
                                      const ForwardOptions& opt, bool cached, std::vector<int32_t>* argmax) {
  Impl& I = *impl_;
  const ModelSpec& sp = spec_;
  const int64_t T = int64_t(ids.size()), D = sp.hidden_size, L = sp.num_hidden_layers;
  for (int j : opt.hidden_states)
    if (j < 0 || j > L) throw std::invalid_argument("hidden state index " + std::to_string(j) + " outside 0.." + std::to_string(L));
  int64_t last = opt.logits || argmax || cached ? L - 1 : -1;  // a cache needs every layer
  for (int j : opt.hidden_states) last = std::max<int64_t>(last, j == L ? L - 1 : j - 1);
  ForwardOutput out;
  auto want = [&](int64_t j) { return std::find(opt.hidden_states.begin(), opt.hidden_states.end(), j) != opt.hidden_states.end(); };
  auto keep = [&](int64_t j, const float* p) {
    if (j == L || !want(j)) return;  // index L is after the final norm (below)
    Tensor t({T, D});
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(t.data.data(), p, t.data.size() * 4, cudaMemcpyDeviceToHost, I.s));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(I.s));
    out.hidden_states[int(j)] = std::move(t);
  };
  StreamBuffer<float> x = run_layers(ids, cu, last, keep, cached, cached && opt.keep_rollback);
  if (last == L - 1 && (opt.logits || argmax || want(L))) I.stage("lm_head");
  if (last == L - 1) finish_forward(x, T, opt, out, argmax);
  if (I.timer) I.timer->stop();
  return out;
}

void TargetGpu::finish_forward(StreamBuffer<float>& x, int64_t T, const ForwardOptions& opt, ForwardOutput& out,
                               std::vector<int32_t>* argmax) {
  Impl& I = *impl_;
  const ModelSpec& sp = spec_;
  const int64_t D = sp.hidden_size, L = sp.num_hidden_layers, V = sp.vocab_size;
  const bool want_L = std::find(opt.hidden_states.begin(), opt.hidden_states.end(), int(L)) != opt.hidden_states.end();
  if (!opt.logits && !want_L && !argmax) return;
  StreamBuffer<bf16> hf(size_t(T * D), I.s);
  cuda::rms_norm_forward(x.data(), I.norm.data(), hf.data(), nullptr, T, D, sp.rms_norm_eps, sp.zero_centered_norm(), I.s);
  if (want_L) {
    Tensor t({T, D});
    t.data = host_f32(hf, T * D, I.s);
    out.hidden_states[int(L)] = std::move(t);
  }
  if (opt.logits) {
    StreamBuffer<float> lg(size_t(T * sp.vocab_size), I.s);
    I.gemm.gemm({T, sp.vocab_size, D, false, true}, hf.data(), I.lm_head.data(), lg.data());
    out.logits = Tensor({T, sp.vocab_size});
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(out.logits.data.data(), lg.data(), lg.size() * 4, cudaMemcpyDeviceToHost, I.s));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(I.s));
  }
  if (argmax) *argmax = cuda::lm_head_argmax(I.gemm, hf.data(), I.lm_head.data(), T, D, V);
}

void TargetGpu::forward_taps(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu,
                             const std::vector<int64_t>& layer_ids, bf16* out) {
  const int64_t T = int64_t(ids.size()), D = spec_.hidden_size, K = int64_t(layer_ids.size());
  if (layer_ids.empty()) throw std::invalid_argument("forward_taps: no layer ids");
  for (int64_t id : layer_ids)
    if (id < 0 || id >= spec_.num_hidden_layers)
      throw std::invalid_argument("forward_taps: layer id " + std::to_string(id) + " outside the target's " +
                                  std::to_string(spec_.num_hidden_layers) + " layers");
  const int64_t last = *std::max_element(layer_ids.begin(), layer_ids.end());
  StreamBuffer<bf16> xb(size_t(T * D), impl_->s);
  const int64_t L = spec_.num_hidden_layers;
  run_layers(ids, cu, last, [&](int64_t j, const float* x) {
    bool converted = false;
    for (int64_t k = 0; k < K; ++k)
      if (layer_ids[size_t(k)] + 1 == j) {  // tap i = hidden_states[i + 1]
        if (!converted) {
          // transformers' hidden_states[L] (a tap of the last layer) is after the final norm
          if (j == L)
            cuda::rms_norm_forward(x, impl_->norm.data(), xb.data(), nullptr, T, D, spec_.rms_norm_eps,
                                   spec_.zero_centered_norm(), impl_->s);
          else
            cuda::f32_to_bf16(x, xb.data(), T * D, impl_->s);
          converted = true;
        }
        DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(out + k * D, size_t(K * D) * 2, xb.data(), size_t(D) * 2, size_t(D) * 2,
                                            size_t(T), cudaMemcpyDeviceToDevice, impl_->s));
      }
  });
  if (impl_->timer) impl_->timer->stop();
}

cuda::GemmContext& TargetGpu::gemm() { return impl_->gemm; }
TargetDtype TargetGpu::dtype() const { return impl_->dtype; }

void TargetGpu::time_stages(bool on) {
  impl_->timer = on ? std::make_unique<cuda::StageTimer>(impl_->s, true) : nullptr;
}

std::vector<std::pair<std::string, double>> TargetGpu::last_stage_ms() const {
  if (!impl_->timer) return {};
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(impl_->s));
  return impl_->timer->totals();
}

}  // namespace dflash
