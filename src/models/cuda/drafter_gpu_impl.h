// DrafterGpu's state, shared by its training step (drafter_gpu.cpp) and its drafting
// (drafter_gpu_draft.cpp). Internal to src/models/cuda.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "models/cuda/drafter_gpu.h"
#include "models/cuda/kv_cache.h"
#include "ops/cuda/gemm.h"

namespace dflash {

struct DrafterGpu::Impl {
  cudaStream_t s;
  cuda::GemmContext gemm;
  int64_t n = 0;                                  // parameters
  cuda::DeviceArray<float> master, grad, m, v;    // flat fp32 [n]
  // zero_grads() was called and no gradient has been written since: `grad` holds stale values that
  // count as zero. The next backward overwrites every gradient (beta 0 GEMMs; the norm weights'
  // gradients zeroed first); whatever reads `grad` before that zeroes it (grad_buffer()).
  bool grad_zero_pending = false;
  cuda::DeviceArray<cuda::bf16> wb;               // flat bf16 copy [n]
  std::map<std::string, int64_t> offset;          // parameter name -> flat offset
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  cuda::DeviceArray<cuda::bf16> embed, lm_head;   // [V, d]
  int64_t V = 0;
  cuda::DeviceArray<double> sumsq, norm, sumsq_ws;
  cuda::DeviceArray<float> coef;
  cuda::DeviceArray<double> inv_freq;             // RoPE [head_dim / 2], computed in double as the reference
  KvCache ctx;                                    // drafting: each layer's context keys / values per sequence
  // The AdamW update runs on its own stream `upd`, one launch per parameter group in the order the
  // next forward reads them (group 0: fc, hidden_norm, norm; group 1 + i: draft layer i), each
  // followed by its event: the next step's forward waits per group, so that the update (memory bound)
  // runs beside the forward's products. Everything else waits for the whole update first (join()).
  cudaStream_t upd = nullptr;
  std::vector<std::pair<int64_t, int64_t>> groups;  // flat [begin, end) per group
  std::vector<cudaEvent_t> upd_done;                // [groups.size()]
  cudaEvent_t grads_ready = nullptr;
  bool update_pending = false;

  explicit Impl(cudaStream_t st) : s(st), gemm(st) {
    DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&upd, cudaStreamNonBlocking));
    DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&grads_ready, cudaEventDisableTiming));
  }
  ~Impl() {
    cudaStreamSynchronize(upd);  // (no throw from a destructor: errors surface at the next call)
    for (cudaEvent_t e : upd_done) cudaEventDestroy(e);
    cudaEventDestroy(grads_ready);
    cudaStreamDestroy(upd);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  /// Stream s waits for the update of parameter group g (nothing when no update is pending).
  void wait_update(size_t g) {
    if (update_pending) DFLASH_CUDA_CHECK(cudaStreamWaitEvent(s, upd_done.at(g), 0));
  }
  /// Stream s waits for the whole pending update (its last group's event).
  void join() {
    if (!update_pending) return;
    DFLASH_CUDA_CHECK(cudaStreamWaitEvent(s, upd_done.back(), 0));
    update_pending = false;
  }
  const cuda::bf16* W(const std::string& name) const { return wb.data() + offset.at(name); }
  const float* F(const std::string& name) const { return master.data() + offset.at(name); }
  float* G(const std::string& name) { return grad.data() + offset.at(name); }
  /// The gradient buffer (after any pending update), zeroed first if a zero_grads() is pending.
  float* grad_buffer() {
    join();
    if (grad_zero_pending) grad.fill_bytes(0, s);
    grad_zero_pending = false;
    return grad.data();
  }
};

/// "layers.<i>.<w>": the name of draft layer i's parameter w.
inline std::string layer_param(int64_t i, const char* w) { return "layers." + std::to_string(i) + "." + w; }

/// Draft layer i's gate_proj, which up_proj follows in the flat buffers (checked by DrafterGpu's
/// allocation): from it, W / G give both as one [2 I, d] matrix, the weight of one GEMM whose output
/// rows are gate | up (cuda::swiglu_forward's layout).
inline std::string gate_up_param(int64_t i) { return layer_param(i, "mlp.gate_proj.weight"); }

}  // namespace dflash
