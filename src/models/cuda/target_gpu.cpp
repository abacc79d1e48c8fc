// Dense target forward on the GPU: embed, per layer pre-norm attention + SwiGLU MLP with residuals,
// final norm, lm_head; hidden states in bf16 (the residual stream is bf16 as in transformers' bf16).
#include "models/cuda/target_gpu.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "models/cuda/kv_cache.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gated_delta_rule.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/masked_attention.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/norm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/stage_timer.h"
#include "ops/rope.h"
#include "tensor/dtype.h"

namespace dflash {

using cuda::bf16;
using cuda::DeviceArray;
using cuda::StreamBuffer;

namespace {

/// New tokens per sequence up to which a cached forward is a decoding step (a verification block is
/// 16): its GatedDeltaNet layers run token by token (gated_delta_rule_recurrent), not chunked.
constexpr int64_t kDecodeTokens = 16;

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

/// One projection's weight [N, K] (nn.Linear layout) as the products read it: bf16 (w), or, under
/// TargetDtype::kFp8, E4M3 (q) with one fp32 scale per output channel (scale [N]).
struct LinearGpu {
  DeviceArray<bf16> w;
  DeviceArray<cuda::fp8> q;
  DeviceArray<float> scale;
  size_t size() const { return w.size() + q.size(); }  // elements of the matrix
  /// `w` [rows, size / rows] kept as it is, or quantized (per row) and dropped.
  static LinearGpu of(DeviceArray<bf16> w, int64_t rows, TargetDtype dtype, cudaStream_t s) {
    LinearGpu l;
    if (dtype == TargetDtype::kBf16) {
      l.w = std::move(w);
      return l;
    }
    l.q = DeviceArray<cuda::fp8>(w.size()), l.scale = DeviceArray<float>(size_t(rows));
    cuda::quantize_rows_fp8(w.data(), rows, int64_t(w.size()) / rows, l.q.data(), l.scale.data(), s);
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));  // before w is freed
    return l;
  }
};

struct LayerGpu {
  LayerKind kind = LayerKind::Attention;
  LinearGpu q, q_gate, k, v, o;  // attention (q, q_gate: [H*Dh, D])
  LinearGpu gate_up, down;       // MLP: gate_proj then up_proj rows [2 Im, D] (one GEMM), down_proj
  DeviceArray<float> q_norm, k_norm, in_ln, post_ln;
  // GatedDeltaNet: in_proj [C + Hv*dv + 2 Hv, D] (the rows of in_proj_qkv [C, D], in_proj_z
  // [Hv*dv, D], in_proj_b and in_proj_a [Hv, D]: one GEMM), out_proj [D, Hv*dv]; conv1d [C, K],
  // A_log / dt_bias [Hv], norm [dv] fp32.
  LinearGpu in_proj, out;
  DeviceArray<float> conv, A_log, dt_bias, gnorm;
  // Mixture of experts (instead of gate / up / down): see cuda::MoeWeightsGpu.
  bool moe = false;
  DeviceArray<bf16> router, experts_gate_up, experts_down, shared_gate_up, shared_down;
  cuda::MoeWeightsGpu moe_weights() const {
    return {router.data(), experts_gate_up.data(), experts_down.data(), shared_gate_up.data(), shared_down.data()};
  }
};

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

/// The cuBLASLt workspace of the target's GemmContext.
constexpr size_t kTargetGemmWorkspaceBytes = size_t(32) << 20;

std::vector<float> host_f32(const StreamBuffer<bf16>& b, int64_t n, cudaStream_t s) {
  std::vector<uint16_t> h(static_cast<size_t>(n));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(h.data(), b.data(), size_t(n) * 2, cudaMemcpyDeviceToHost, s));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> r(h.size());
  for (size_t i = 0; i < h.size(); ++i) r[i] = bf16_to_f32(h[i]);
  return r;
}

}  // namespace

struct TargetGpu::Impl {
  cudaStream_t s;
  TargetDtype dtype = TargetDtype::kBf16;
  cuda::GemmContext gemm;
  std::vector<LayerGpu> layers;
  DeviceArray<bf16> embed, lm_head;
  DeviceArray<float> norm;
  DeviceArray<double> inv_freq;
  KvCache cache;
  /// Decoding state of the GatedDeltaNet layers (empty for attention layers), per layer.
  struct GdnCache {
    DeviceArray<float> window, state;                     // [n, K-1, C], [n, Hv, dk, dv]
    // Of the last keep_rollback forward: each sequence's state before it, the conv history, and every
    // token's recurrence inputs (q | k | v | g | beta, GdnInputs) to replay an accepted prefix from.
    DeviceArray<float> state_before, hist, inputs;
  };
  std::vector<GdnCache> gdn;
  std::vector<int64_t> rollback_from;  // per sequence: its length before that forward (-1: none)
  std::vector<int64_t> rollback_cu;    // that forward's cu_seqlens (rows of hist and inputs)
  std::vector<int64_t> replay;         // per sequence: accepted tokens of that forward still to replay
  std::unique_ptr<cuda::StageTimer> timer;  // while time_stages(true)
  Impl(cudaStream_t st, TargetDtype d) : s(st), dtype(d), gemm(st, kTargetGemmWorkspaceBytes, true) {}  // tuned GEMMs (GemmTune::kAuto)
  void stage(const char* name) {
    if (timer) timer->next(name);
  }
};

namespace {
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

namespace {
/// Offsets (floats) of one forward's GatedDeltaNet recurrence inputs in GdnCache::inputs, for T tokens:
/// q [T, Hk, dk], k [T, Hk, dk], v [T, Hv, dv], g [T, Hv], beta [T, Hv].
struct GdnInputs {
  int64_t nq, nv, ng, q, k, v, g, beta, total;
  GdnInputs(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv)
      : nq(T * Hk * dk), nv(T * Hv * dv), ng(T * Hv), q(0), k(nq), v(2 * nq), g(2 * nq + nv), beta(g + ng),
        total(beta + ng) {}
};

bool has_gated_deltanet(const ModelSpec& sp) {
  return std::count(sp.layer_types.begin(), sp.layer_types.end(), LayerKind::GatedDeltaNet) > 0;
}

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
  const int64_t T = int64_t(ids.size()), D = sp.hidden_size, H = sp.num_attention_heads, Hkv = sp.num_key_value_heads;
  const int64_t Dh = sp.head_dim, Im = sp.intermediate_size, rot = sp.rotary_dim();
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
  // Positions continue each cached sequence. Cached keys of sequence q sit at rows q * cap + j of
  // the layer's cache; new keys are scattered there. For the attention, each sequence's queries
  // start a fresh 64-row tile (rows `qrow`, Tq in all): a tile then spans one sequence's keys only.
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::vector<int32_t> dest, qrow;
  std::vector<cuda::KvRange32> rg;
  if (cached) {
    dest.resize(size_t(T));
    qrow.resize(size_t(T));
  } else {
    rg = cuda::causal_ranges(cu);
  }
  int64_t Tq = 0;
  for (size_t q = 0; q + 1 < cu.size(); ++q) {
    for (int64_t t = cu[q]; t < cu[q + 1]; ++t) {
      pos[size_t(t)] = t - cu[q] + (cached ? C.len[q] : 0);
      if (!cached) continue;
      const int64_t base = int64_t(q) * C.cap;
      dest[size_t(t)] = int32_t(base + pos[size_t(t)]);
      qrow[size_t(t)] = int32_t(Tq + t - cu[q]);
    }
    if (!cached) continue;
    rg.resize(size_t(Tq + (cu[q + 1] - cu[q] + 63) / 64 * 64));
    for (int64_t t = cu[q]; t < cu[q + 1]; ++t)
      rg[size_t(qrow[size_t(t)])] = {int32_t(int64_t(q) * C.cap), int32_t(int64_t(q) * C.cap + pos[size_t(t)] + 1), 0, 0};
    Tq = int64_t(rg.size());
  }
  auto d_pos = cuda::upload(pos, s);
  auto d_ids = cuda::upload(ids, s);
  auto d_dest = cuda::upload(dest, s), d_qrow = cuda::upload(qrow, s);
  auto ranges = cuda::upload(rg, s);
  // A decoding step (at most kDecodeTokens new tokens in every sequence) runs GatedDeltaNet token by
  // token, as verification does: plain and speculative decoding then make the same states. The
  // longest sequence of the forward decides for all of it.
  int64_t max_new = 0;
  for (size_t q = 0; q + 1 < cu.size(); ++q) max_new = std::max(max_new, cu[q + 1] - cu[q]);
  const bool token_by_token = cached && (keep_rollback || max_new <= kDecodeTokens);
  // The chunked rule reads the values in place from the conv output (row stride Cg); the
  // token-by-token path and the rollback copy take them copied into gv.
  const bool v_copy = token_by_token || (cached && keep_rollback);
  const ForwardSizes z = forward_sizes(sp, I.dtype, T, Tq, cached, v_copy, token_by_token);
  StreamBuffer<bf16> qpad(size_t(z.qpad), s), opad(size_t(z.opad), s);
  if (cached) DFLASH_CUDA_CHECK(cudaMemsetAsync(qpad.data(), 0, qpad.size() * 2, s));  // padding rows: defined
  StreamBuffer<float> cs(size_t(z.cs), s), sn(size_t(z.sn), s);
  cuda::rope_table(d_pos.data(), I.inv_freq.data(), T, rot, cs.data(), sn.data(), s);
  if (I.timer) I.timer->clear();
  I.stage("other");
  StreamBuffer<float> x(size_t(z.x), s);  // the residual stream, fp32 (GEMM inputs are bf16)
  StreamBuffer<bf16> h(size_t(z.h), s), q(size_t(z.q), s), k(size_t(z.k), s), v(size_t(z.v), s), o(size_t(z.o), s),
      gu(size_t(z.gu), s), act(size_t(z.act), s);
  cuda::embedding_gather(I.embed.data(), sp.vocab_size, D, d_ids.data(), T, h.data(), nullptr, s);
  cuda::bf16_to_f32(h.data(), x.data(), T * D, s);
  on_hidden(0, x.data());
  const float scale = float(1.0 / std::sqrt(double(Dh)));
  // y [T, out_f] (+)= in [T, in_f] @ w^T. Under kFp8 `in` is first quantized per token into aq / as,
  // unless `same_input`: the caller's promise that the previous product read this very input, unchanged.
  StreamBuffer<cuda::fp8> aq(size_t(z.aq), s);
  StreamBuffer<float> as(size_t(z.as), s);
  const bf16* quantized = nullptr;
  auto linear = [&](const bf16* in, int64_t out_f, int64_t in_f, const LinearGpu& w, auto* y, float beta,
                    bool same_input = false) {
    I.stage("gemm");
    if (I.dtype == TargetDtype::kBf16) return I.gemm.gemm({T, out_f, in_f, false, true}, in, w.w.data(), y, 1.f, beta);
    if (!same_input || quantized != in) cuda::quantize_rows_fp8(in, T, in_f, aq.data(), as.data(), s);
    quantized = in;
    I.gemm.gemm_fp8({T, out_f, in_f, false, true}, aq.data(), as.data(), w.q.data(), w.scale.data(), y, beta);
  };
  // GatedDeltaNet buffers (hybrids): C = q | k | v channels; in_proj's output row: q | k | v | z | b | a.
  const int64_t Hk = sp.linear_num_key_heads, Hv = sp.linear_num_value_heads, dk = sp.linear_key_head_dim;
  const int64_t dv = sp.linear_value_head_dim, Cg = 2 * Hk * dk + Hv * dv, Nin = Cg + Hv * dv + 2 * Hv;
  const bool hybrid = has_gated_deltanet(sp);
  StreamBuffer<int32_t> d_start = cuda::upload(hybrid ? cuda::sequence_starts(cu) : std::vector<int32_t>{}, s);
  std::optional<cuda::GdnChunkPlan> gdn_chunks;  // the chunk list, once for every GatedDeltaNet layer
  if (hybrid && !token_by_token) gdn_chunks.emplace(cu, s);
  // With a cache: each token's sequence and the cu_seqlens as int32 for the windowed conv.
  std::vector<int32_t> seq_of, cu32;
  if (cached && hybrid) {
    for (size_t q = 0; q + 1 < cu.size(); ++q) {
      cu32.push_back(int32_t(cu[q]));
      seq_of.insert(seq_of.end(), size_t(cu[q + 1] - cu[q]), int32_t(q));
    }
    cu32.push_back(int32_t(cu.back()));
  }
  auto d_seq_of = cuda::upload(seq_of, s), d_cu32 = cuda::upload(cu32, s);
  const int Kc = int(sp.linear_conv_kernel_dim);
  const float q_scale = float(1.0 / std::sqrt(double(dk)));
  const int64_t state_elems = Hv * dk * dv;
  // GatedDeltaNet fp32 activations (without a cache, the chunked rule reads in_proj's output itself)
  StreamBuffer<float> gconv(size_t(z.gconv), s), gq(size_t(z.gq), s), gk(size_t(z.gk), s), gv(size_t(z.gv), s),
      go(size_t(z.go), s), gg(size_t(z.gg), s), gbeta(size_t(z.gbeta), s);
  StreamBuffer<bf16> gin(size_t(z.gin), s);          // in_proj's output (bf16, as in transformers)
  StreamBuffer<bf16> gnormed(size_t(z.gnormed), s);  // out_proj's input
  const bf16* gz = hybrid ? gin.data() + Cg : nullptr;  // z, b, a read in place from gin (row stride Nin)
  const bf16 *gb = hybrid ? gz + Hv * dv : nullptr, *ga = hybrid ? gb + Hv : nullptr;
  const bool gated = sp.attn_output_gate();
  StreamBuffer<bf16> og(size_t(z.og), s);  // the output gate's logits
  const cuda::MoeShape moe_shape{T, D, int(sp.num_experts), int(sp.num_experts_per_tok), sp.moe_intermediate_size,
                                 sp.shared_expert_intermediate_size, sp.norm_topk_prob};
  for (int64_t i = 0; i <= last; ++i) {
    const LayerGpu& l = I.layers[size_t(i)];
    I.stage("other");
    cuda::rms_norm_forward(x.data(), l.in_ln.data(), h.data(), nullptr, T, D, sp.rms_norm_eps, zc, s);
    if (l.kind == LayerKind::GatedDeltaNet) {
      // transformers Qwen3_5GatedDeltaNet (no cache): in_proj (q|k|v, z, b, a in one GEMM), conv1d +
      // SiLU over q|k|v, gates, the chunked gated delta rule, gated RMSNorm with silu(z), out_proj.
      linear(h.data(), Nin, D, l.in_proj, gin.data(), 0.f);
      I.stage("gated_deltanet");
      Impl::GdnCache* gc = cached ? &I.gdn[size_t(i)] : nullptr;
      if (gc) {  // continue each sequence's conv window, then move it past the new tokens; q, k, v, gates
        cuda::causal_conv1d_silu_window(gin.data(), Nin, l.conv.data(), gc->window.data(), d_seq_of.data(),
                                        d_cu32.data(), T, Cg, Kc, gconv.data(), s);
        const size_t hist_rows = size_t(C.n * (Kc - 1) + T);
        if (keep_rollback && gc->hist.size() < hist_rows * size_t(Cg)) gc->hist = DeviceArray<float>(hist_rows * size_t(Cg));
        StreamBuffer<float> tmp(keep_rollback ? 0 : hist_rows * size_t(Cg), s);
        cuda::conv_window_advance(gc->window.data(), gin.data(), Nin, d_cu32.data(), C.n, T, Cg, Kc,
                                  keep_rollback ? gc->hist.data() : tmp.data(), s);
        cuda::gdn_prepare(gconv.data(), gb, ga, Nin, l.A_log.data(), l.dt_bias.data(), T, int(Hk), int(Hv), int(dk),
                          int(dv), q_scale, gq.data(), gk.data(), v_copy ? gv.data() : nullptr, gg.data(),
                          gbeta.data(), s);
      }  // (without a cache the conv1d, the q / k l2norm and the gates run inside the chunked rule: from)
      if (gc && keep_rollback) {  // keep the state before and every token's inputs
        const size_t n_state = size_t(C.n * state_elems);
        if (gc->state_before.size() < n_state) gc->state_before = DeviceArray<float>(n_state);
        const GdnInputs in(T, Hk, Hv, dk, dv);
        if (gc->inputs.size() < size_t(in.total)) gc->inputs = DeviceArray<float>(size_t(in.total));
        float* keep = gc->inputs.data();
        for (const auto& [src, off, n] : {std::tuple{gq.data(), in.q, in.nq}, std::tuple{gk.data(), in.k, in.nq},
                                          std::tuple{gv.data(), in.v, in.nv}, std::tuple{gg.data(), in.g, in.ng},
                                          std::tuple{gbeta.data(), in.beta, in.ng}})
          DFLASH_CUDA_CHECK(cudaMemcpyAsync(keep + off, src, size_t(n) * 4, cudaMemcpyDeviceToDevice, s));
        DFLASH_CUDA_CHECK(cudaMemcpyAsync(gc->state_before.data(), gc->state.data(), n_state * 4, cudaMemcpyDeviceToDevice, s));
      }
      if (token_by_token) {
        cuda::gated_delta_rule_recurrent(gq.data(), gk.data(), gv.data(), gg.data(), gbeta.data(), cu, int(Hk), int(Hv),
                                         int(dk), int(dv), gc->state.data(), nullptr, go.data(), s);
        cuda::gated_rms_norm(go.data(), gz, Hv, Nin, l.gnorm.data(), gnormed.data(), T * Hv, dv, sp.rms_norm_eps, s);
      } else {  // the cached state in and out (in place: each block reads its slice before writing it); the
                // gated RMSNorm applied to the output inside the kernel
        const cuda::GatedNormOut norm{gz, Nin, l.gnorm.data(), float(sp.rms_norm_eps), gnormed.data()};
        const cuda::GdnProjections from{gin.data(), Nin, l.conv.data(), Kc, gb, ga, Nin, l.A_log.data(),
                                        l.dt_bias.data(), q_scale, d_start.data()};
        const float* gv_in = !gc ? nullptr : v_copy ? gv.data() : gconv.data() + 2 * Hk * dk;
        cuda::gated_delta_rule_chunked(gq.data(), gk.data(), gv_in, gg.data(), gbeta.data(), *gdn_chunks, int(Hk),
                                       int(Hv), int(dk), int(dv), gc ? gc->state.data() : nullptr,
                                       gc ? gc->state.data() : nullptr, nullptr, s, 0, gc && !v_copy ? Cg : 0, &norm,
                                       gc ? nullptr : &from);
      }
      linear(gnormed.data(), D, Hv * dv, l.out, x.data(), 1.f);  // x += out_proj(o)
    } else {
      linear(h.data(), H * Dh, D, l.q, q.data(), 0.f);
      if (gated) linear(h.data(), H * Dh, D, l.q_gate, og.data(), 0.f, true);
      linear(h.data(), Hkv * Dh, D, l.k, k.data(), 0.f, true);
      linear(h.data(), Hkv * Dh, D, l.v, v.data(), 0.f, true);
      I.stage("attention");
      if (sp.has_qk_norm()) {
        cuda::rms_norm_forward(q.data(), l.q_norm.data(), q.data(), nullptr, T * H, Dh, sp.rms_norm_eps, zc, s);
        cuda::rms_norm_forward(k.data(), l.k_norm.data(), k.data(), nullptr, T * Hkv, Dh, sp.rms_norm_eps, zc, s);
      }
      cuda::rope_apply(q.data(), T, H, Dh, rot, cs.data(), sn.data(), false, s);
      cuda::rope_apply(k.data(), T, Hkv, Dh, rot, cs.data(), sn.data(), false, s);
      if (cached) {
        cuda::scatter_rows(k.data(), T, Hkv * Dh, d_dest.data(), C.k[size_t(i)].data(), s);
        cuda::scatter_rows(v.data(), T, Hkv * Dh, d_dest.data(), C.v[size_t(i)].data(), s);
        cuda::scatter_rows(q.data(), T, H * Dh, d_qrow.data(), qpad.data(), s);  // unused rows: empty ranges
        cuda::masked_attention_forward(qpad.data(), C.k[size_t(i)].data(), C.v[size_t(i)].data(), ranges.data(), Tq,
                                       C.n * C.cap, int(H), int(Hkv), int(Dh), scale, opad.data(), nullptr, s);
        cuda::embedding_gather(opad.data(), Tq, H * Dh, d_qrow.data(), T, o.data(), nullptr, s);
      } else {
        cuda::masked_attention_forward(q.data(), k.data(), v.data(), ranges.data(), T, T, int(H), int(Hkv), int(Dh),
                                       scale, o.data(), nullptr, s);
      }
      if (gated) cuda::mul_sigmoid(o.data(), og.data(), T * H * Dh, s);
      linear(o.data(), D, H * Dh, l.o, x.data(), 1.f);  // x += o_proj(o)
    }
    I.stage("other");
    cuda::rms_norm_forward(x.data(), l.post_ln.data(), h.data(), nullptr, T, D, sp.rms_norm_eps, zc, s);
    if (l.moe) {
      I.stage("moe");
      cuda::moe_ffn_forward(I.gemm, moe_shape, l.moe_weights(), h.data(), x.data());  // x += moe(h)
    } else {
      linear(h.data(), 2 * Im, D, l.gate_up, gu.data(), 0.f);  // gate | up
      I.stage("other");
      cuda::swiglu_forward(gu.data(), T, Im, act.data(), s);
      linear(act.data(), D, Im, l.down, x.data(), 1.f);  // x += down_proj(act)
    }
    I.stage("other");
    on_hidden(i + 1, x.data());
  }
  if (cached) {
    // As TargetCache: a forward without keep_rollback seals the tokens it adds; a sequence it gives
    // no tokens keeps what the last verification saved (hist and inputs are left alone).
    if (hybrid && keep_rollback) I.rollback_cu = cu;
    for (int q = 0; q < C.n; ++q) {
      const int64_t n = cu[size_t(q) + 1] - cu[size_t(q)];
      if (hybrid && keep_rollback) I.rollback_from[size_t(q)] = C.len[size_t(q)];
      else if (hybrid && n > 0) I.rollback_from[size_t(q)] = -1;
      C.len[size_t(q)] += n;
    }
  }
  return x;
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
