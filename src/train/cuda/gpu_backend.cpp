#include "train/cuda/gpu_backend.h"

#include <nccl.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <string>
#include <thread>

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

  void zero_grads() override {
    on_device();
    drafter_.zero_grads();
  }

  MicroResult micro_step(const TrainSample& s, const std::vector<int64_t>& anchors, double gamma) override {
    if (s.loss_mask.size() != s.ids.size()) throw std::invalid_argument("loss_mask and ids differ in length");
    on_device();
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

  void scale_grads(double f) override {
    on_device();
    drafter_.scale_grads(float(f));
  }

  ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) override {
    on_device();
    return drafter_.optimizer_step(o, lr, max_norm, t);
  }

  OptimizerState state() const override {
    on_device();
    OptimizerState st;
    st.weights = drafter_.weights();
    drafter_.moments(&st.exp_avg, &st.exp_avg_sq);
    return st;
  }

  void set_state(const OptimizerState& s) override {
    on_device();
    drafter_.set_state(s.weights, s.exp_avg, s.exp_avg_sq);
  }

  std::string device() const override { return "cuda:" + std::to_string(device_); }

  int device_index() const { return device_; }
  DrafterGpu& drafter() { return drafter_; }

 private:
  /// Every call may come from another thread: make this GPU current first.
  void on_device() const { DFLASH_CUDA_CHECK(cudaSetDevice(device_)); }

  DrafterConfig cfg_;
  int device_;
  bool recompute_;
  Stream stream_;
  TargetGpu target_;
  DrafterGpu drafter_;
};

#define DFLASH_NCCL_CHECK(call)                                                                         \
  do {                                                                                                  \
    const ncclResult_t r_ = (call);                                                                     \
    if (r_ != ncclSuccess) throw std::runtime_error(std::string("NCCL: ") + #call + ": " + ncclGetErrorString(r_)); \
  } while (0)

/// fn(i) for i in [0, n) on n threads at once; rethrows the exception of the lowest failing i.
void on_threads(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::exception_ptr> err(n);
  std::vector<std::thread> th;
  for (size_t i = 0; i < n; ++i)
    th.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        err[i] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

/// Data parallelism over several GPUs of this process: one GpuBackend (target + drafter replica) per
/// GPU, one thread per GPU per call. The micro-batches of a step are dealt round-robin to the
/// replicas; optimizer_step sums the gradients with an NCCL all-reduce (every replica then holds the
/// step's total) and runs the same clip + AdamW on each, so the replicas stay bitwise equal
/// (identical inputs, deterministic kernels, and NCCL gives every rank the same sum).
class DataParallelBackend final : public DrafterBackend {
 public:
  DataParallelBackend(const DrafterConfig& cfg, const DrafterWeights<float>& w, const TargetModel& target,
                      const std::vector<int>& devices, bool recompute) {
    for (int d : devices) reps_.push_back(std::make_unique<GpuBackend>(cfg, w, target, d, recompute));  // host memory: one at a time
    comms_.resize(devices.size());
    DFLASH_NCCL_CHECK(ncclCommInitAll(comms_.data(), int(devices.size()), devices.data()));
  }
  ~DataParallelBackend() override {
    for (ncclComm_t c : comms_) ncclCommDestroy(c);
  }

  void zero_grads() override {
    on_threads(reps_.size(), [&](size_t i) { reps_[i]->zero_grads(); });
  }

  MicroResult micro_step(const TrainSample& s, const std::vector<int64_t>& anchors, double gamma) override {
    return reps_[0]->micro_step(s, anchors, gamma);
  }

  std::vector<MicroResult> micro_steps(const std::vector<MicroBatch>& mbs, double gamma) override {
    std::vector<MicroResult> r(mbs.size());
    std::vector<std::exception_ptr> err(mbs.size());
    on_threads(reps_.size(), [&](size_t i) {
      for (size_t j = i; j < mbs.size(); j += reps_.size()) {
        try {
          r[j] = reps_[i]->micro_step(*mbs[j].sample, mbs[j].anchors, gamma);
        } catch (...) {
          err[j] = std::current_exception();
          return;
        }
      }
    });
    for (size_t j = 0; j < mbs.size(); ++j)
      if (err[j]) try {
          std::rethrow_exception(err[j]);
        } catch (const std::exception& e) {
          throw std::runtime_error("training example " + std::to_string(mbs[j].sample->index) + " (on " +
                                   reps_[j % reps_.size()]->device() + "): " + e.what());
        }
    return r;
  }

  void scale_grads(double f) override {
    on_threads(reps_.size(), [&](size_t i) { reps_[i]->scale_grads(f); });
  }

  ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) override {
    DFLASH_NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < reps_.size(); ++i) {
      DrafterGpu& d = reps_[i]->drafter();
      DFLASH_CUDA_CHECK(cudaSetDevice(reps_[i]->device_index()));
      DFLASH_NCCL_CHECK(ncclAllReduce(d.grad_data(), d.grad_data(), size_t(d.num_params()), ncclFloat32, ncclSum,
                                      comms_[i], d.stream()));
    }
    DFLASH_NCCL_CHECK(ncclGroupEnd());
    std::vector<ClipResult> r(reps_.size());
    on_threads(reps_.size(), [&](size_t i) { r[i] = reps_[i]->optimizer_step(o, lr, max_norm, t); });
    return r[0];
  }

  OptimizerState state() const override { return reps_[0]->state(); }

  void set_state(const OptimizerState& s) override {
    on_threads(reps_.size(), [&](size_t i) { reps_[i]->set_state(s); });
  }

  std::string device() const override {
    std::string r = "cuda:";
    for (size_t i = 0; i < reps_.size(); ++i) r += (i ? "," : "") + std::to_string(reps_[i]->device_index());
    return r;
  }

 private:
  std::vector<std::unique_ptr<GpuBackend>> reps_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                                 const TargetModel& target, const std::vector<int>& devices,
                                                 bool recompute) {
  if (devices.empty()) throw std::invalid_argument("make_gpu_backend: no GPU given");
  if (devices.size() == 1) return std::make_unique<GpuBackend>(cfg, weights, target, devices[0], recompute);
  return std::make_unique<DataParallelBackend>(cfg, weights, target, devices, recompute);
}

}  // namespace dflash
