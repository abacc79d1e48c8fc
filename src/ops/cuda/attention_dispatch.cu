// The masked attention's entry points (masked_attention.h): argument checks, the choice between the
// warpgroup-MMA and mma.sync kernels (attention_kernels.h), the backward's workspace and launch order.
#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "gpu/device_info.h"
#include "gpu/fast_math.cuh"
#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/masked_attention.h"

namespace dflash::cuda {

namespace {

using namespace detail;

/// Rows of the head-major row statistics: Nq rounded up to whole query tiles (BM).
int padded_rows(int64_t Nq) { return int((Nq + BM - 1) / BM * BM); }

/// Parts of the dK / dV launch: the mma.sync kernel splits in 2 once there are kSplitQueryTiles query
/// tiles or more. The wgmma kernel runs unsplit: its 128-key CTAs, one per SM, measured 1.36 ms per 8B
/// drafter layer against 1.52 + 0.07 ms split in two parts with the reduction.
constexpr int kSplitQueryTiles = 16;
int dkv_parts(int64_t Nq, bool wgmma) { return !wgmma && (Nq + BM - 1) / BM >= kSplitQueryTiles ? 2 : 1; }

void check_args(int64_t Nq, int64_t Nk, int H, int Hkv, float scale, const char* what) {
  if (Nq < 0 || Nk < 0 || Nq > INT_MAX / 2 || Nk > INT_MAX / 2 || H <= 0 || Hkv <= 0 || H % Hkv)
    throw std::invalid_argument(std::string(what) + ": bad sizes (Nq " + std::to_string(Nq) + ", Nk " +
                                std::to_string(Nk) + ", H " + std::to_string(H) + ", Hkv " + std::to_string(Hkv) + ")");
  if (!(scale > 0.f) || !std::isfinite(scale * kLog2e))  // the kernels take maxima of unscaled scores
    throw std::invalid_argument(std::string(what) + ": scale " + std::to_string(scale) + " is not a positive finite number");
}

/// The backward's kernels: row statistics and tile table, dQ and dK / dV (wgmma or mma.sync), and the
/// reduction of a split dK / dV launch.
void launch_bwd(int D, const bf16* q, const bf16* k, const bf16* v, const bf16* o, const float* lse, const bf16* dout,
                const KvRange32* r, int Nq, int Nk, int H, int Hkv, float scale, bf16* dq, bf16* dk, bf16* dv,
                float* delta_t, float* lse2_t, int4* tiles, float* partials, bool wgmma, cudaStream_t s) {
  const int Nqp = padded_rows(Nq);
  attention_bwd_stats(D, o, dout, lse, r, Nq, Nqp, H, delta_t, lse2_t, tiles, s);
  const int parts = dkv_parts(Nq, wgmma), qtiles = (Nq + BM - 1) / BM, qpp = (qtiles + parts - 1) / parts;
  float* pdk = parts > 1 ? partials : nullptr;
  float* pdv = parts > 1 ? partials + int64_t(parts) * Nk * Hkv * D : nullptr;
  if (wgmma)
    attention_bwd_wgmma(q, k, v, dout, r, Nq, Nqp, Nk, H, Hkv, scale, dq, delta_t, lse2_t, tiles, parts, qpp, dk, dv,
                        pdk, pdv, s);
  else
    attention_bwd_mma(D, q, k, v, dout, r, Nq, Nqp, Nk, H, Hkv, scale, dq, delta_t, lse2_t, tiles, parts, qpp, dk, dv,
                      pdk, pdv, s);
  if (parts > 1) attention_dkv_reduce(pdk, pdv, parts, int64_t(Nk) * Hkv * D, dk, dv, s);
}

}  // namespace

bool masked_attention_uses_wgmma(int D) { return (D == 128 || D == 256) && runs_sm90a(); }

namespace {
bool backward_uses_wgmma(int D, AttentionKernel kernel) {
  return D == 128 && kernel == AttentionKernel::kAuto && masked_attention_uses_wgmma(D);
}
}  // namespace

void masked_attention_forward(const bf16* q, const bf16* k, const bf16* v, const KvRange32* ranges, int64_t Nq,
                              int64_t Nk, int H, int Hkv, int D, float scale, bf16* o, float* lse,
                              cudaStream_t stream, AttentionKernel kernel) {
  check_args(Nq, Nk, H, Hkv, scale, "masked_attention_forward");
  if (Nq == 0) return;
  switch (D) {
    case 64: return attention_fwd_mma(64, q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
    case 128:  // (no key at all: the mma.sync kernel, which needs no TMA descriptor of K and V)
    case 256:
      if (kernel == AttentionKernel::kAuto && Nk > 0 && masked_attention_uses_wgmma(D))
        return attention_fwd_wgmma(D, q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
      return attention_fwd_mma(D, q, k, v, ranges, int(Nq), int(Nk), H, Hkv, scale, o, lse, stream);
    default: throw std::invalid_argument("masked_attention_forward: head_dim " + std::to_string(D) + " not in {64, 128, 256}");
  }
}

namespace {
int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }
/// Bytes of the row statistics delta_t and lse2_t, [H][padded_rows(Nq)] fp32 each.
int64_t row_stats_bytes(int64_t Nq, int H) { return 2 * int64_t(H) * padded_rows(Nq) * int64_t(sizeof(float)); }
}  // namespace

int64_t masked_attention_backward_workspace_bytes(int64_t Nq, int64_t Nk, int H, int Hkv, int D,
                                                  AttentionKernel kernel) {
  const int parts = dkv_parts(Nq, backward_uses_wgmma(D, kernel));
  return row_stats_bytes(Nq, H) + align16(2 * ((Nq + BM - 1) / BM) * int64_t(sizeof(int4))) +
         (parts > 1 ? 2 * int64_t(parts) * Nk * Hkv * D * int64_t(sizeof(float)) : 0);
}

void masked_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* o, const float* lse,
                               const bf16* dout, const KvRange32* ranges, int64_t Nq, int64_t Nk, int H, int Hkv,
                               int D, float scale, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                               cudaStream_t stream, AttentionKernel kernel) {
  check_args(Nq, Nk, H, Hkv, scale, "masked_attention_backward");
  if (D != 64 && D != 128)
    throw std::invalid_argument("masked_attention_backward: head_dim " + std::to_string(D) + " not in {64, 128}");
  if (Nk > 0 && Nq == 0) {
    DFLASH_CUDA_CHECK(cudaMemsetAsync(dk, 0, size_t(Nk) * Hkv * D * sizeof(bf16), stream));
    DFLASH_CUDA_CHECK(cudaMemsetAsync(dv, 0, size_t(Nk) * Hkv * D * sizeof(bf16), stream));
  }
  if (Nq > 0 && Nk == 0) DFLASH_CUDA_CHECK(cudaMemsetAsync(dq, 0, size_t(Nq) * H * D * sizeof(bf16), stream));
  if (Nq == 0 || Nk == 0) return;
  char* ws = static_cast<char*>(workspace);
  float* delta_t = reinterpret_cast<float*>(ws);
  float* lse2_t = delta_t + int64_t(H) * padded_rows(Nq);
  int4* tiles = reinterpret_cast<int4*>(ws + row_stats_bytes(Nq, H));
  float* partials = reinterpret_cast<float*>(reinterpret_cast<char*>(tiles) + align16(2 * ((Nq + BM - 1) / BM) * int64_t(sizeof(int4))));
  launch_bwd(D, q, k, v, o, lse, dout, ranges, int(Nq), int(Nk), H, Hkv, scale, dq, dk, dv, delta_t, lse2_t, tiles,
             partials, backward_uses_wgmma(D, kernel), stream);
}

}  // namespace dflash::cuda
