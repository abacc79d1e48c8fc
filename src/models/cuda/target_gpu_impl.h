// What the TargetGpu sources share (target_gpu.cpp: weights, cache, forward; target_gpu_layers.cpp:
// the layers of a forward): the device weights of a layer and TargetGpu::Impl.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/runtime.h"
#include "gpu/stage_timer.h"
#include "models/cuda/kv_cache.h"
#include "models/cuda/target_gpu.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"

namespace dflash {

/// New tokens per sequence up to which a cached forward is a decoding step (a verification block is
/// 16): its GatedDeltaNet layers run token by token (gated_delta_rule_recurrent), not chunked.
constexpr int64_t kDecodeTokens = 16;

/// One projection's weight [N, K] (nn.Linear layout) as the products read it: bf16 (w), or, under
/// TargetDtype::kFp8, E4M3 (q) with one fp32 scale per output channel (scale [N]).
struct LinearGpu {
  cuda::DeviceArray<cuda::bf16> w;
  cuda::DeviceArray<cuda::fp8> q;
  cuda::DeviceArray<float> scale;
  size_t size() const { return w.size() + q.size(); }  // elements of the matrix
  /// `w` [rows, size / rows] kept as it is, or quantized (per row) and dropped.
  static LinearGpu of(cuda::DeviceArray<cuda::bf16> w, int64_t rows, TargetDtype dtype, cudaStream_t s) {
    LinearGpu l;
    if (dtype == TargetDtype::kBf16) {
      l.w = std::move(w);
      return l;
    }
    l.q = cuda::DeviceArray<cuda::fp8>(w.size()), l.scale = cuda::DeviceArray<float>(size_t(rows));
    cuda::quantize_rows_fp8(w.data(), rows, int64_t(w.size()) / rows, l.q.data(), l.scale.data(), s);
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(s));  // before w is freed
    return l;
  }
};

struct LayerGpu {
  LayerKind kind = LayerKind::Attention;
  LinearGpu q, q_gate, k, v, o;  // attention (q, q_gate: [H*Dh, D])
  LinearGpu gate_up, down;       // MLP: gate_proj then up_proj rows [2 Im, D] (one GEMM), down_proj
  cuda::DeviceArray<float> q_norm, k_norm, in_ln, post_ln;
  // GatedDeltaNet: in_proj [C + Hv*dv + 2 Hv, D] (the rows of in_proj_qkv [C, D], in_proj_z
  // [Hv*dv, D], in_proj_b and in_proj_a [Hv, D]: one GEMM), out_proj [D, Hv*dv]; conv1d [C, K],
  // A_log / dt_bias [Hv], norm [dv] fp32.
  LinearGpu in_proj, out;
  cuda::DeviceArray<float> conv, A_log, dt_bias, gnorm;
  // Mixture of experts (instead of gate / up / down): see cuda::MoeWeightsGpu.
  bool moe = false;
  cuda::DeviceArray<cuda::bf16> router, experts_gate_up, experts_down, shared_gate_up, shared_down;
  cuda::MoeWeightsGpu moe_weights() const {
    return {router.data(), experts_gate_up.data(), experts_down.data(), shared_gate_up.data(), shared_down.data()};
  }
};

/// The cuBLASLt workspace of the target's GemmContext.
constexpr size_t kTargetGemmWorkspaceBytes = size_t(32) << 20;

struct TargetGpu::Impl {
  cudaStream_t s;
  TargetDtype dtype = TargetDtype::kBf16;
  cuda::GemmContext gemm;
  std::vector<LayerGpu> layers;
  cuda::DeviceArray<cuda::bf16> embed, lm_head;
  cuda::DeviceArray<float> norm;
  cuda::DeviceArray<double> inv_freq;
  KvCache cache;
  /// Decoding state of the GatedDeltaNet layers (empty for attention layers), per layer.
  struct GdnCache {
    cuda::DeviceArray<float> window, state;                     // [n, K-1, C], [n, Hv, dk, dv]
    // Of the last keep_rollback forward: each sequence's state before it, the conv history, and every
    // token's recurrence inputs (q | k | v | g | beta, GdnInputs) to replay an accepted prefix from.
    cuda::DeviceArray<float> state_before, hist, inputs;
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

/// Offsets (floats) of one forward's GatedDeltaNet recurrence inputs in GdnCache::inputs, for T tokens:
/// q [T, Hk, dk], k [T, Hk, dk], v [T, Hv, dv], g [T, Hv], beta [T, Hv].
struct GdnInputs {
  int64_t nq, nv, ng, q, k, v, g, beta, total;
  GdnInputs(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv)
      : nq(T * Hk * dk), nv(T * Hv * dv), ng(T * Hv), q(0), k(nq), v(2 * nq), g(2 * nq + nv), beta(g + ng),
        total(beta + ng) {}
};

inline bool has_gated_deltanet(const ModelSpec& sp) {
  return std::count(sp.layer_types.begin(), sp.layer_types.end(), LayerKind::GatedDeltaNet) > 0;
}

}  // namespace dflash
