#include "train/cuda/gpu_backend.h"

#include <chrono>
#include <cmath>

#include "models/cuda/drafter_gpu.h"
#include "models/cuda/target_gpu.h"

namespace dflash {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct Stream {
  cudaStream_t s{};
  explicit Stream(int device) {
    DFLASH_CUDA_CHECK(cudaSetDevice(device));
    DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
  }
  ~Stream() { cudaStreamDestroy(s); }
};

class GpuBackend final : public DrafterBackend {
 public:
  GpuBackend(const DrafterConfig& cfg, const DrafterWeights<float>& w, const TargetModel& target, int device,
             bool recompute)
      : cfg_(cfg), device_(device), recompute_(recompute), stream_(device), target_(target, stream_.s),
        drafter_(cfg, w, target.embed_tokens(), target.lm_head(), stream_.s) {
    // Keep freed stream-ordered memory in the pool between steps (no OS round trips per step).
    cudaMemPool_t pool;
    DFLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    DFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }

  void zero_grads() override { drafter_.zero_grads(); }

  MicroResult micro_step(const TrainSample& s, const std::vector<int64_t>& anchors, double gamma) override {
    if (s.loss_mask.size() != s.ids.size()) throw std::invalid_argument("loss_mask and ids differ in length");
    const int64_t S = int64_t(s.ids.size()), K = int64_t(cfg_.target_layer_ids.size()), d = cfg_.hidden_size;
    MicroResult r;
    auto t0 = std::chrono::steady_clock::now();
    std::vector<int32_t> ids(s.ids.begin(), s.ids.end());
    cuda::StreamBuffer<cuda::bf16> taps(size_t(S * K * d), stream_.s);
    target_.forward_taps(ids, {0, S}, cfg_.target_layer_ids, taps.data());
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_.s));
    r.target_ms = ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    DrafterGpuSequence seq{taps.data(), s.ids, std::vector<int64_t>(s.loss_mask.begin(), s.loss_mask.end()), anchors,
                           int64_t(anchors.size()), gamma};
    if (!anchors.empty()) {
      DrafterGpuStepOptions so;
      so.recompute = recompute_;
      const DrafterGpuStepResult d2 = drafter_.step(seq, so);
      r.loss = d2.loss, r.weight_sum = d2.weight_sum;
      r.slot_correct = d2.slot_correct, r.slot_count = d2.slot_count;
    } else {
      r.slot_correct.assign(size_t(cfg_.block_size), 0);
      r.slot_count.assign(size_t(cfg_.block_size), 0);
    }
    r.drafter_ms = ms_since(t0);
    return r;
  }

  void scale_grads(double f) override { drafter_.scale_grads(float(f)); }

  ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) override {
    return drafter_.optimizer_step(o, lr, max_norm, t);
  }

  OptimizerState state() const override {
    OptimizerState st;
    st.weights = drafter_.weights();
    drafter_.moments(&st.exp_avg, &st.exp_avg_sq);
    return st;
  }

  void set_state(const OptimizerState& s) override { drafter_.set_state(s.weights, s.exp_avg, s.exp_avg_sq); }

  std::string device() const override { return "cuda:" + std::to_string(device_); }

 private:
  DrafterConfig cfg_;
  int device_;
  bool recompute_;
  Stream stream_;
  TargetGpu target_;
  DrafterGpu drafter_;
};

}  // namespace

std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                                 const TargetModel& target, int device, bool recompute) {
  return std::make_unique<GpuBackend>(cfg, weights, target, device, recompute);
}

}  // namespace dflash
