#include "ops/cuda/moe.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "gpu/fast_math.cuh"
#include "gpu/mma.cuh"
#include "ops/cuda/elementwise.h"

namespace dflash::cuda {

namespace {

using namespace mma;

constexpr int kMaxExperts = 1024;  // moe_route keeps one bit per expert a lane owns (32 lanes x 32)

// ---- router: one warp per token ----
__device__ __forceinline__ void warp_best(float& v, int& idx) {
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) v = ov, idx = oi;
  }
}

__global__ void route_kernel(const float* __restrict__ logits, int64_t ld, int64_t T, int E, int k, bool renorm,
                             int32_t* __restrict__ ids, float* __restrict__ weights, int32_t* __restrict__ counts) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (t >= T) return;
  const float* l = logits + t * ld;
  float m = -INFINITY;
  bool bad = false;
  for (int e = lane; e < E; e += 32) {
    const float v = l[e];
    bad |= !isfinite(v);
    m = fmaxf(m, v);
  }
  bad = __any_sync(0xffffffffu, bad);
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float z = 0.f;
  for (int e = lane; e < E; e += 32) z += expf(l[e] - m);
  for (int o = 16; o; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
  // k rounds of a warp argmax over the experts not picked yet (bit i of `taken`: expert lane + 32 i).
  uint32_t taken = 0;
  float my_p = 0.f, sum = 0.f;
  int my_id = 0;
  for (int j = 0; j < k; ++j) {
    float v = -INFINITY;
    int idx = INT_MAX;
    for (int i = 0, e = lane; e < E; ++i, e += 32)
      if (!((taken >> i) & 1u) && (l[e] > v || idx == INT_MAX)) v = l[e], idx = e;
    warp_best(v, idx);
    if (bad) idx = j;  // NaN / Inf: fixed experts, NaN weights below
    if ((idx & 31) == lane) taken |= 1u << (idx >> 5);
    const float p = expf(v - m) / z;
    sum += p;
    if (lane == j) my_p = p, my_id = idx;
  }
  if (lane < k) {
    ids[t * k + lane] = my_id;
    weights[t * k + lane] = bad ? NAN : renorm ? my_p / sum : my_p;
    atomicAdd(&counts[my_id], 1);
  }
}

// ---- permutation: offsets and tile table (one block), then a slot per pick ----
constexpr int kScanThreads = 256, kScanItems = kMaxExperts / kScanThreads;

__global__ void __launch_bounds__(kScanThreads) plan_kernel(const int32_t* __restrict__ counts, int E,
                                                           int32_t* __restrict__ offsets, int32_t* __restrict__ tile_start,
                                                           int32_t* __restrict__ fill) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int c[kScanItems], tiles[kScanItems];
  for (int i = 0; i < kScanItems; ++i) {
    const int e = threadIdx.x * kScanItems + i;
    c[i] = e < E ? counts[e] : 0;
    tiles[i] = (c[i] + kGroupedGemmRows - 1) / kGroupedGemmRows;
  }
  int sum_c, sum_t;
  Scan(tmp).ExclusiveSum(c, c, sum_c);
  __syncthreads();
  Scan(tmp).ExclusiveSum(tiles, tiles, sum_t);
  for (int i = 0; i < kScanItems; ++i) {
    const int e = threadIdx.x * kScanItems + i;
    if (e < E) offsets[e] = c[i], tile_start[e] = tiles[i], fill[e] = 0;
  }
  if (threadIdx.x == 0) offsets[E] = sum_c, tile_start[E] = sum_t;  // every thread holds the totals
}

__global__ void scatter_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ offsets, int64_t n, int k,
                               int32_t* __restrict__ fill, int32_t* __restrict__ rows, int32_t* __restrict__ slot_of) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int e = ids[i];
    const int slot = offsets[e] + atomicAdd(&fill[e], 1);
    rows[slot] = int32_t(i / k);
    slot_of[i] = slot;
  }
}

// ---- grouped GEMM: a CTA computes a 64 x 128 tile of C with 4 warps (each 32 x 64), K in steps of 32
// through a 3-stage cp.async pipeline. blockIdx.x walks N (so consecutive CTAs share their A rows and
// an expert's weights stay in L2 for its next row tile), blockIdx.y is the row tile.
constexpr int GBM = kGroupedGemmRows, GBN = 128, GBK = 32, GLD = GBK + 8, kStages = 3;

__global__ void __launch_bounds__(128) grouped_gemm_kernel(const bf16* __restrict__ A, const int32_t* __restrict__ a_rows,
                                                           const bf16* __restrict__ B, const int32_t* __restrict__ offsets,
                                                           const int32_t* __restrict__ tile_start, int E, int N, int K,
                                                           float* __restrict__ C) {
  const int tile = blockIdx.y;
  if (tile >= tile_start[E]) return;
  int lo = 0, hi = E;  // tile_start[lo] <= tile < tile_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_start[mid] <= tile) lo = mid;
    else hi = mid;
  }
  const int e = lo, m0 = offsets[e] + (tile - tile_start[e]) * GBM, m_end = offsets[e + 1], n0 = blockIdx.x * GBN;
  const bf16* Be = B + int64_t(e) * N * K;
  __shared__ alignas(16) bf16 As[kStages][GBM * GLD];
  __shared__ alignas(16) bf16 Bs[kStages][GBN * GLD];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  // Each thread copies 2 16-byte chunks of the A tile and 4 of the B tile per K step.
  const bf16* a_src[2];
  bool a_ok[2];
  for (int i = 0; i < 2; ++i) {
    const int c = tid + i * 128, m = m0 + c / 4;
    a_ok[i] = m < m_end;
    a_src[i] = A + int64_t(a_ok[i] ? (a_rows ? a_rows[m] : m) : 0) * K + (c % 4) * 8;
  }
  const bf16* b_src[4];
  bool b_ok[4];
  for (int i = 0; i < 4; ++i) {
    const int c = tid + i * 128, n = n0 + c / 4;
    b_ok[i] = n < N;
    b_src[i] = Be + int64_t(b_ok[i] ? n : 0) * K + (c % 4) * 8;
  }
  const int KT = (K + GBK - 1) / GBK;
  auto load = [&](int stage, int kt) {
    const int k0 = kt * GBK;
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * 128;
      const bool ok = a_ok[i] && k0 + (c % 4) * 8 < K;
      cp_async16(&As[stage][(c / 4) * GLD + (c % 4) * 8], ok ? a_src[i] + k0 : A, ok);
    }
    for (int i = 0; i < 4; ++i) {
      const int c = tid + i * 128;
      const bool ok = b_ok[i] && k0 + (c % 4) * 8 < K;
      cp_async16(&Bs[stage][(c / 4) * GLD + (c % 4) * 8], ok ? b_src[i] + k0 : B, ok);
    }
  };
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < KT) load(st, st);
    cp_async_commit();
  }
  float acc[2][8][4] = {};
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // step kt has landed; every warp is done with the stage refilled below
    const int nk = kt + kStages - 1;
    if (nk < KT) load(nk % kStages, nk);
    cp_async_commit();
    const bf16* as = As[kt % kStages];
    const bf16* bs = Bs[kt % kStages];
#pragma unroll
    for (int kk = 0; kk < GBK / 16; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) load_a_x4(a[mi], as, GLD, wm * 32 + mi * 16, kk * 16, lane);
#pragma unroll
      for (int nj = 0; nj < 4; ++nj) {
        uint32_t b[4];
        load_b_x4(b, bs, GLD, wn * 64 + nj * 16, kk * 16, lane);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma16816(acc[mi][2 * nj], a[mi], b[0], b[1]);
          mma16816(acc[mi][2 * nj + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = n0 + wn * 64 + nt * 8 + 2 * t, r0 = m0 + wm * 32 + mi * 16 + g;
      if (col >= N) continue;
      if (r0 < m_end) *reinterpret_cast<float2*>(C + int64_t(r0) * N + col) = make_float2(acc[mi][nt][0], acc[mi][nt][1]);
      if (r0 + 8 < m_end)
        *reinterpret_cast<float2*>(C + int64_t(r0 + 8) * N + col) = make_float2(acc[mi][nt][2], acc[mi][nt][3]);
    }
}

// ---- elementwise: SwiGLU of the experts' [gate | up] rows, and the weighted combination ----
__global__ void expert_swiglu_kernel(const float* __restrict__ gu, int64_t rows, int64_t Im, bf16* __restrict__ act) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * Im; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / Im, c = i % Im;
    const float gt = gu[r * 2 * Im + c], up = gu[r * 2 * Im + Im + c];
    act[i] = __float2bfloat16(fast_silu(gt) * up);
  }
}

__global__ void combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ slot_of,
                               const float* __restrict__ weights, int k, const float* __restrict__ shared,
                               const float* __restrict__ shared_logit, int64_t ld, int64_t T, int64_t D,
                               float* __restrict__ x) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < T * D; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, c = i % D;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += weights[t * k + j] * y[int64_t(slot_of[t * k + j]) * D + c];
    if (shared) acc += shared[i] * fast_sigmoid(shared_logit[t * ld]);
    x[i] += acc;
  }
}

void check_experts(int E, int k, const char* what) {
  if (E < 1 || E > kMaxExperts || k < 1 || k > 32 || k > E)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(k) + " of " + std::to_string(E) +
                                " experts (the GPU kernels take up to " + std::to_string(kMaxExperts) +
                                " experts and 1..32 per token)");
}

}  // namespace

void moe_route(const float* logits, int64_t ld, int64_t T, int E, int k, bool norm_topk_prob, int32_t* ids,
               float* weights, int32_t* counts, cudaStream_t stream) {
  check_experts(E, k, "moe_route");
  if (ld < E) throw std::invalid_argument("moe_route: leading dimension below the number of experts");
  if (T <= 0) return;
  route_kernel<<<unsigned((T * 32 + 255) / 256), 256, 0, stream>>>(logits, ld, T, E, k, norm_topk_prob, ids, weights,
                                                                   counts);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void moe_permute(const int32_t* ids, const int32_t* counts, int64_t T, int E, int k, int32_t* offsets,
                 int32_t* tile_start, int32_t* rows, int32_t* slot_of, cudaStream_t stream) {
  check_experts(E, k, "moe_permute");
  StreamBuffer<int32_t> fill(size_t(E), stream);
  plan_kernel<<<1, kScanThreads, 0, stream>>>(counts, E, offsets, tile_start, fill.data());
  DFLASH_CUDA_CHECK_LAUNCH();
  if (T <= 0) return;
  scatter_kernel<<<grid_for(T * k), 256, 0, stream>>>(ids, offsets, T * k, k, fill.data(), rows, slot_of);
  DFLASH_CUDA_CHECK_LAUNCH();
}

void grouped_gemm(const bf16* A, const int32_t* a_rows, const bf16* B, const int32_t* offsets, const int32_t* tile_start,
                  int E, int64_t total_rows, int64_t N, int64_t K, float* C, cudaStream_t stream) {
  if (N <= 0 || K <= 0 || N % 8 || K % 8)
    throw std::invalid_argument("grouped_gemm: N " + std::to_string(N) + " and K " + std::to_string(K) +
                                " must be positive multiples of 8");
  const int64_t max_tiles = total_rows / GBM + E;  // sum over experts of ceil(count / GBM)
  if (max_tiles >= 65536)
    throw std::invalid_argument("grouped_gemm: " + std::to_string(total_rows) + " rows over " + std::to_string(E) +
                                " experts exceed the grid (65535 row tiles)");
  if (total_rows <= 0) return;
  const dim3 grid(unsigned((N + GBN - 1) / GBN), unsigned(max_tiles));
  grouped_gemm_kernel<<<grid, 128, 0, stream>>>(A, a_rows, B, offsets, tile_start, E, int(N), int(K), C);
  DFLASH_CUDA_CHECK_LAUNCH();
}

namespace {
/// Elements of moe_ffn_forward's temporaries (n = T k routed rows): what it allocates, and what
/// moe_ffn_workspace_bytes adds up.
struct MoeTemps {
  int64_t logits, wts, y, experts_gu, sh;  // f32
  int64_t ids, counts, offsets, tiles, rows, slot_of;  // int32
  int64_t experts_act, shared_gu, shared_act;  // bf16
  explicit MoeTemps(const MoeShape& s) {
    const int64_t n = s.T * s.k, ld = s.E + (s.Is > 0 ? 1 : 0);
    logits = s.T * ld, wts = n, y = n * s.D, experts_gu = n * 2 * s.Im, sh = s.Is > 0 ? s.T * s.D : 0;
    ids = n, counts = s.E, offsets = s.E + 1, tiles = s.E + 1, rows = n, slot_of = n;
    experts_act = n * s.Im, shared_gu = s.Is > 0 ? s.T * 2 * s.Is : 0, shared_act = s.Is > 0 ? s.T * s.Is : 0;
  }
  /// The routing and the experts' outputs live throughout; then the experts' gate | up and act, then
  /// the shared expert's output with its gate | up and act.
  int64_t peak_bytes() const {
    const int64_t base = 4 * (logits + wts + y) + 4 * (ids + counts + offsets + tiles + rows + slot_of);
    return base + std::max(4 * experts_gu + 2 * experts_act, 4 * sh + 2 * (shared_gu + shared_act));
  }
};
}  // namespace

int64_t moe_ffn_workspace_bytes(const MoeShape& s) { return s.T <= 0 ? 0 : MoeTemps(s).peak_bytes(); }

void moe_ffn_forward(GemmContext& gemm, const MoeShape& s, const MoeWeightsGpu& w, const bf16* h, float* x) {
  check_experts(s.E, s.k, "moe_ffn_forward");
  if (s.T <= 0) return;
  if (s.T * s.k / GBM + s.E >= 65536)  // grouped_gemm's grid; also keeps row offsets within int32
    throw std::invalid_argument("moe_ffn_forward: " + std::to_string(s.T) + " tokens x " + std::to_string(s.k) +
                                " experts each exceed one forward's " + std::to_string((65535 - s.E) * GBM) +
                                " expert rows: run fewer tokens per forward");
  cudaStream_t st = gemm.stream();
  const int64_t T = s.T, D = s.D, Im = s.Im, Is = s.Is, n = T * s.k, ld = s.E + (Is > 0 ? 1 : 0);
  const MoeTemps z(s);
  StreamBuffer<float> logits(size_t(z.logits), st), wts(size_t(z.wts), st);
  gemm.gemm({T, ld, D, false, true}, h, w.router, logits.data());  // router and shared gate logits
  StreamBuffer<int32_t> ids(size_t(z.ids), st), counts(size_t(z.counts), st), offsets(size_t(z.offsets), st),
      tiles(size_t(z.tiles), st), rows(size_t(z.rows), st), slot_of(size_t(z.slot_of), st);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(counts.data(), 0, size_t(s.E) * 4, st));
  moe_route(logits.data(), ld, T, s.E, s.k, s.norm_topk_prob, ids.data(), wts.data(), counts.data(), st);
  moe_permute(ids.data(), counts.data(), T, s.E, s.k, offsets.data(), tiles.data(), rows.data(), slot_of.data(), st);
  StreamBuffer<float> y(size_t(z.y), st);
  {
    StreamBuffer<float> gu(size_t(z.experts_gu), st);
    grouped_gemm(h, rows.data(), w.gate_up, offsets.data(), tiles.data(), s.E, n, 2 * Im, D, gu.data(), st);
    StreamBuffer<bf16> act(size_t(z.experts_act), st);
    expert_swiglu_kernel<<<grid_for(n * Im), 256, 0, st>>>(gu.data(), n, Im, act.data());
    DFLASH_CUDA_CHECK_LAUNCH();
    grouped_gemm(act.data(), nullptr, w.down, offsets.data(), tiles.data(), s.E, n, D, Im, y.data(), st);
  }
  StreamBuffer<float> sh(size_t(z.sh), st);
  if (Is > 0) {
    StreamBuffer<bf16> gu(size_t(z.shared_gu), st), act(size_t(z.shared_act), st);
    gemm.gemm({T, 2 * Is, D, false, true}, h, w.shared_gate_up, gu.data());
    swiglu_forward(gu.data(), T, Is, act.data(), st);
    gemm.gemm({T, D, Is, false, true}, act.data(), w.shared_down_proj, sh.data());
  }
  combine_kernel<<<grid_for(T * D), 256, 0, st>>>(y.data(), slot_of.data(), wts.data(), s.k,
                                                  Is > 0 ? sh.data() : nullptr, logits.data() + s.E, ld, T, D, x);
  DFLASH_CUDA_CHECK_LAUNCH();
}

}  // namespace dflash::cuda
