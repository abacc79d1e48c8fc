#include "train/cuda/gpu_backend.h"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>

#include "models/cuda/drafter_gpu.h"
#include "models/cuda/target_gpu.h"
#include "train/distributed.h"
#include "train/pipeline.h"
#include "common/clock.h"
#include "tensor/dtype.h"

namespace dflash {

namespace {

using cuda::bf16;

#define DFLASH_NCCL_CHECK(call)                                                                                  \
  do {                                                                                                           \
    const ncclResult_t r_ = (call);                                                                              \
    if (r_ != ncclSuccess) throw std::runtime_error(std::string("NCCL: ") + #call + ": " + ncclGetErrorString(r_)); \
  } while (0)

/// A stream on `device`, which becomes the current device. Stream-ordered memory freed on the device
/// stays in its pool between steps (no OS round trips per step).
struct Stream {
  cudaStream_t s{};
  explicit Stream(int device) {
    DFLASH_CUDA_CHECK(cudaSetDevice(device));
    DFLASH_CUDA_CHECK(cudaStreamCreate(&s));
    cudaMemPool_t pool;
    DFLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    DFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  ~Stream() { cudaStreamDestroy(s); }
};

/// The frozen target on one GPU: computes a sample's taps [S, K*d] bf16 on that GPU.
struct TargetReplica {
  int device;
  Stream stream;
  std::unique_ptr<TargetGpu> target;
  TargetReplica(const GpuReplicaFactory& f, int dev) : device(dev), stream(dev), target(f.target(stream.s)) {}

  /// Taps of several samples in one packed forward (cu_seqlens): sample i's rows follow sample i-1's.
  void taps(const std::vector<const TrainSample*>& ss, const std::vector<int64_t>& layer_ids, bf16* out) {
    DFLASH_CUDA_CHECK(cudaSetDevice(device));
    std::vector<int32_t> ids;
    std::vector<int64_t> cu = {0};
    for (const TrainSample* s : ss) {
      ids.insert(ids.end(), s->ids.begin(), s->ids.end());
      cu.push_back(int64_t(ids.size()));
    }
    target->forward_taps(ids, cu, layer_ids, out);
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
};

/// A drafter replica on one GPU (fp32 masters, gradients and AdamW moments; bf16 working weights).
struct DrafterReplica {
  int device;
  Stream stream;
  std::unique_ptr<DrafterGpu> holder;
  DrafterGpu& drafter;
  int taps_checked = 0;  // micro-batches whose taps were checked (this replica's thread only)
  DrafterReplica(const GpuReplicaFactory& f, int dev)
      : device(dev), stream(dev), holder(f.drafter(stream.s)), drafter(*holder) {}

  /// The drafter's forward + backward on taps already on this GPU (gradients added).
  MicroResult step(const bf16* taps, const TrainSample& s, const std::vector<int64_t>& anchors,
                   const LossWeighting& loss, bool recompute) {
    DFLASH_CUDA_CHECK(cudaSetDevice(device));
    const auto t0 = std::chrono::steady_clock::now();
    MicroResult r;
    const int64_t B = drafter.config().block_size;
    if (taps_checked < kTapCheckedMicroBatches) {  // the first micro-batches' taps, on the host (tap_check.h)
      ++taps_checked;
      const std::vector<int64_t> layers = captured_layer_ids(drafter.config());
      const int64_t S = int64_t(s.ids.size()), width = int64_t(layers.size()) * drafter.config().hidden_size;
      std::vector<uint16_t> h(static_cast<size_t>(S * width));
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(h.data(), taps, h.size() * 2, cudaMemcpyDeviceToHost, stream.s));
      DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream.s));
      std::vector<float> f(h.size());
      for (size_t i = 0; i < h.size(); ++i) f[i] = bf16_to_f32(h[i]);
      r.tap_stats = tap_stats(f.data(), S, layers, drafter.config().hidden_size);
    }
    if (!anchors.empty()) {
      DrafterGpuSequence seq{taps, s.ids, std::vector<int64_t>(s.loss_mask.begin(), s.loss_mask.end()), anchors,
                             int64_t(anchors.size()), loss.gamma, loss.dpace};
      const DrafterConfig& c = drafter.config();
      cuda::StreamBuffer<bf16> own_taps, final_hidden;  // DSpark: the captured rows split (freed in stream order)
      if (c.is_dspark()) {  // rows [taps (K d) | final hidden (d)] -> [S, K d] and [S, d]
        const int64_t S = int64_t(s.ids.size()), d = c.hidden_size, Kd = int64_t(c.target_layer_ids.size()) * d;
        own_taps = cuda::StreamBuffer<bf16>(size_t(S * Kd), stream.s);
        final_hidden = cuda::StreamBuffer<bf16>(size_t(S * d), stream.s);
        DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(own_taps.data(), size_t(Kd) * 2, taps, size_t(Kd + d) * 2, size_t(Kd) * 2,
                                            size_t(S), cudaMemcpyDeviceToDevice, stream.s));
        DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(final_hidden.data(), size_t(d) * 2, taps + Kd, size_t(Kd + d) * 2,
                                            size_t(d) * 2, size_t(S), cudaMemcpyDeviceToDevice, stream.s));
        seq.taps = own_taps.data();
        seq.target_hidden = final_hidden.data();
      }
      DrafterGpuStepOptions so;
      so.recompute = recompute;
      DrafterGpuStepResult d;
      try {
        d = drafter.step(seq, so);
      } catch (...) {  // the work queued before the error still reads the taps: let it finish first
        cudaStreamSynchronize(stream.s);
        throw;
      }
      r.loss = d.loss, r.weight_sum = d.weight_sum;
      r.slot_correct = d.slot_correct, r.slot_count = d.slot_count;
      r.nonfinite_taps = d.nonfinite_taps;
    } else {
      r.slot_correct.assign(size_t(B), 0);
      r.slot_count.assign(size_t(B), 0);
    }
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    r.drafter_ms = ms_since(t0);
    return r;
  }
};

/// Elements of one captured row: the taps (K d), and for DSpark the target's final hidden state (d).
int64_t tap_width(const DrafterConfig& c) { return int64_t(captured_layer_ids(c).size()) * c.hidden_size; }

void check_sample(const DrafterConfig& c, const TrainSample& s) {
  if (s.loss_mask.size() != s.ids.size()) throw std::invalid_argument("loss_mask and ids differ in length");
  for (int64_t t : s.ids)
    if (t < 0 || t >= c.vocab_size) throw std::invalid_argument("token id " + std::to_string(t) + " outside the vocabulary");
}

/// One GPU, target and drafter colocated, everything on the caller's thread.
class GpuBackend final : public DrafterBackend {
 public:
  GpuBackend(const DrafterConfig& cfg, const GpuReplicaFactory& f, int device, const GpuTrainOptions& opt)
      : cfg_(cfg), opt_(opt), target_(f, device), drafter_(f, device) {}

  void zero_grads() override {
    on_device();
    drafter_.drafter.zero_grads();
  }

  MicroResult micro_step(const TrainSample& s, const std::vector<int64_t>& anchors, const LossWeighting& loss) override {
    return micro_steps({MicroBatch{&s, anchors}}, loss).at(0);
  }

  /// Packed target forwards over runs of the micro-batches, then the drafter steps in order.
  std::vector<MicroResult> micro_steps(const std::vector<MicroBatch>& mbs, const LossWeighting& loss) override {
    on_device();
    std::vector<MicroResult> res(mbs.size());
    std::vector<size_t> all(mbs.size());
    for (size_t j = 0; j < all.size(); ++j) all[j] = j;
    for (const std::vector<size_t>& run : pack_runs(all, mbs, opt_.target_batch_tokens)) {
      std::vector<const TrainSample*> ss;
      int64_t tokens = 0;
      for (size_t j : run) {
        try {
          check_sample(cfg_, *mbs[j].sample);
        } catch (const std::exception& e) {
          throw std::runtime_error("training example " + std::to_string(mbs[j].sample->index) + ": " + e.what());
        }
        ss.push_back(mbs[j].sample);
        tokens += int64_t(mbs[j].sample->ids.size());
      }
      const auto t0 = std::chrono::steady_clock::now();
      // On the target's stream; freed there after the drafter steps, which end synchronized.
      cuda::StreamBuffer<bf16> taps(size_t(tokens * tap_width(cfg_)), target_.stream.s);
      target_.taps(ss, captured_layer_ids(cfg_), taps.data());
      const double target_ms = ms_since(t0);
      int64_t row = 0;
      for (size_t j : run) {
        const TrainSample& s = *mbs[j].sample;
        try {
          res[j] = drafter_.step(taps.data() + row * tap_width(cfg_), s, mbs[j].anchors, loss, opt_.recompute);
        } catch (const std::exception& e) {
          throw std::runtime_error("training example " + std::to_string(s.index) + ": " + e.what());
        }
        res[j].target_ms = target_ms * double(s.ids.size()) / double(std::max<int64_t>(tokens, 1));
        row += int64_t(s.ids.size());
      }
    }
    return res;
  }

  void scale_grads(double f) override {
    on_device();
    drafter_.drafter.scale_grads(float(f));
  }

  ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) override {
    on_device();
    return drafter_.drafter.optimizer_step(o, lr, max_norm, t);
  }

  OptimizerState state() const override {
    on_device();
    OptimizerState st;
    st.weights = drafter_.drafter.weights();
    drafter_.drafter.moments(&st.exp_avg, &st.exp_avg_sq);
    return st;
  }

  void set_state(const OptimizerState& s) override {
    on_device();
    drafter_.drafter.set_state(s.weights, s.exp_avg, s.exp_avg_sq);
  }

  std::string first_nonfinite_grad() const override {
    on_device();
    return first_nonfinite(drafter_.drafter.grads());
  }

  std::string device() const override { return "cuda:" + std::to_string(drafter_.device); }

 private:
  void on_device() const { DFLASH_CUDA_CHECK(cudaSetDevice(drafter_.device)); }

  DrafterConfig cfg_;
  GpuTrainOptions opt_;
  TargetReplica target_;
  DrafterReplica drafter_;
};

/// The taps of one packed target forward [tokens, K*d], on the target replica's GPU, stream-ordered
/// on its stream (no device-wide synchronization, which would stall a drafter sharing the GPU);
/// freed by whichever thread drops the last reference, after that reader synchronized its stream.
struct PackedTaps {
  int device = 0;
  cudaStream_t stream{};
  bf16* data = nullptr;
  PackedTaps(size_t n, int dev, cudaStream_t s) : device(dev), stream(s) {
    DFLASH_CUDA_CHECK(cudaSetDevice(dev));
    DFLASH_CUDA_CHECK_ALLOC(cudaMallocAsync(reinterpret_cast<void**>(&data), n * sizeof(bf16), s), n * sizeof(bf16));
  }
  PackedTaps(const PackedTaps&) = delete;
  PackedTaps& operator=(const PackedTaps&) = delete;
  ~PackedTaps() {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    cudaFreeAsync(data, stream);
    cudaSetDevice(prev);
  }
};

/// A micro-batch's taps on the way from a target replica to a drafter replica.
struct TapsMsg {
  std::shared_ptr<PackedTaps> pack;
  int64_t offset = 0, elems = 0;     // this sample's rows in the pack (elements)
  double target_ms = 0;              // its share of the packed forward
};

/// Several GPUs: target replicas on `target_devices`, drafter replicas on `drafter_devices` (equal
/// lists = colocated, one of each per GPU; disjoint = disaggregated; a GPU may hold one of each).
/// Micro-batches are dealt to target and drafter replicas balanced by tokens; a target replica packs
/// runs of its micro-batches into one forward, and each sample's taps are copied (peer to peer when
/// the GPUs differ) to its drafter replica; a thread per replica, the two sides overlapping
/// through bounded queues (2 micro-batches per pair). optimizer_step sums the drafter replicas'
/// gradients with an NCCL all-reduce and runs the same clip + AdamW on each, so the replicas stay
/// bitwise equal (identical inputs, deterministic kernels, the same sum on every NCCL rank).
class MultiGpuBackend final : public DrafterBackend {
 public:
  MultiGpuBackend(const DrafterConfig& cfg, const GpuReplicaFactory& f, const std::vector<int>& target_devices,
                  const std::vector<int>& drafter_devices, const GpuTrainOptions& opt)
      : cfg_(cfg), opt_(opt) {
    // One replica at a time: each upload converts the weights in host memory first.
    for (int d : target_devices) targets_.push_back(std::make_unique<TargetReplica>(f, d));
    for (int d : drafter_devices) drafters_.push_back(std::make_unique<DrafterReplica>(f, d));
    for (int d : drafter_devices)
      for (int t : target_devices) {
        int ok = 0;
        if (d != t && cudaDeviceCanAccessPeer(&ok, d, t) == cudaSuccess && ok) {
          DFLASH_CUDA_CHECK(cudaSetDevice(d));
          const cudaError_t e = cudaDeviceEnablePeerAccess(t, 0);
          if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) DFLASH_CUDA_CHECK(e);
          (void)cudaGetLastError();
          // The packed taps come from t's stream-ordered pool, which peer access does not cover.
          cudaMemPool_t pool;
          DFLASH_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, t));
          cudaMemAccessDesc access{};
          access.location = {cudaMemLocationTypeDevice, d};
          access.flags = cudaMemAccessFlagsProtReadWrite;
          DFLASH_CUDA_CHECK(cudaMemPoolSetAccess(pool, &access, 1));
        }
      }
    const ProcessGroup& pg = opt.pg;
    if (pg.world > 1) {  // one communicator over the drafter replicas of every process
      ncclUniqueId id{};
      if (pg.rank == 0) DFLASH_NCCL_CHECK(ncclGetUniqueId(&id));
      const std::string got = rendezvous(pg, std::string(reinterpret_cast<const char*>(&id), sizeof id),
                                         std::to_string(drafter_devices.size()) + " drafter GPU(s) per process", 900);
      std::memcpy(&id, got.data(), sizeof id);
      const int nd = int(drafter_devices.size());
      comms_.resize(drafters_.size());
      DFLASH_NCCL_CHECK(ncclGroupStart());
      for (int i = 0; i < nd; ++i) {
        DFLASH_CUDA_CHECK(cudaSetDevice(drafter_devices[size_t(i)]));
        DFLASH_NCCL_CHECK(ncclCommInitRank(&comms_[size_t(i)], pg.world * nd, id, pg.rank * nd + i));
      }
      DFLASH_NCCL_CHECK(ncclGroupEnd());
    } else if (drafters_.size() > 1) {
      comms_.resize(drafters_.size());
      DFLASH_NCCL_CHECK(ncclCommInitAll(comms_.data(), int(drafter_devices.size()), drafter_devices.data()));
    }
  }
  ~MultiGpuBackend() override {
    for (ncclComm_t c : comms_) ncclCommDestroy(c);
  }

  void zero_grads() override {
    on_drafters([&](DrafterReplica& r) { r.drafter.zero_grads(); });
  }

  MicroResult micro_step(const TrainSample& s, const std::vector<int64_t>& anchors, const LossWeighting& loss) override {
    return micro_steps({MicroBatch{&s, anchors}}, loss).at(0);
  }

  std::vector<MicroResult> micro_steps(const std::vector<MicroBatch>& mbs, const LossWeighting& loss) override {
    const size_t n = mbs.size(), nt = targets_.size(), nd = drafters_.size();
    // Drafter replicas of all processes, balanced by tokens; this process runs the micro-batches of
    // its own, and its target replicas share them out the same way.
    const int rank = opt_.pg.rank;
    const std::vector<size_t> gj = balance(mbs, size_t(opt_.pg.world) * nd);
    std::vector<size_t> local, dj(n, SIZE_MAX), tj(n, SIZE_MAX);
    std::vector<MicroBatch> sub;
    for (size_t j = 0; j < n; ++j)
      if (gj[j] / nd == size_t(rank)) local.push_back(j), sub.push_back(mbs[j]), dj[j] = gj[j] % nd;
    const std::vector<size_t> ts = balance(sub, nt);
    for (size_t k = 0; k < local.size(); ++k) tj[local[k]] = ts[k];
    std::vector<MicroResult> res(n);
    std::vector<std::exception_ptr> err(n);
    Handoff<TapsMsg> hand(nt, nd, 2);
    on_threads(nt + nd, [&](size_t w) {
      size_t j = 0;
      try {
        if (w < nt) {  // target replica w: packed forwards over its micro-batches, in order
          TargetReplica& tr = *targets_[w];
          std::vector<size_t> mine;
          for (size_t i = 0; i < n; ++i)
            if (tj[i] == w) mine.push_back(i);
          for (const std::vector<size_t>& run : pack_runs(mine, mbs, opt_.target_batch_tokens)) {
            std::vector<TapsMsg> out(run.size());
            std::vector<const TrainSample*> ss;
            int64_t tokens = 0;
            for (size_t i : run) {
              j = i;  // a failure below is reported for this sample
              check_sample(cfg_, *mbs[i].sample);
              ss.push_back(mbs[i].sample);
              tokens += int64_t(mbs[i].sample->ids.size());
            }
            j = run.front();  // a failing packed forward is reported for the run's first sample
            const auto t0 = std::chrono::steady_clock::now();
            auto pack = std::make_shared<PackedTaps>(size_t(tokens * tap_width(cfg_)), tr.device, tr.stream.s);
            tr.taps(ss, captured_layer_ids(cfg_), pack->data);
            const double ms = ms_since(t0);
            int64_t row = 0;
            for (size_t k = 0; k < run.size(); ++k) {
              const int64_t len = int64_t(mbs[run[k]].sample->ids.size());
              out[k] = {pack, row * tap_width(cfg_), len * tap_width(cfg_), ms * double(len) / double(std::max<int64_t>(tokens, 1))};
              row += len;
            }
            for (size_t k = 0; k < run.size(); ++k) {
              j = run[k];
              hand.push(w, dj[run[k]], std::move(out[k]));
            }
          }
        } else {  // drafter replica w - nt: its micro-batches in increasing order
          const size_t d = w - nt;
          DrafterReplica& dr = *drafters_[d];
          for (j = 0; j < n; ++j) {
            if (dj[j] != d) continue;  // (SIZE_MAX: another process's)
            const auto t0 = std::chrono::steady_clock::now();
            TapsMsg m = hand.pop(tj[j], d);
            const double wait_ms = ms_since(t0);
            cuda::StreamBuffer<bf16> local;  // (freed in stream order, after the step)
            const bf16* taps = m.pack->data + m.offset;
            if (m.pack->device != dr.device) {  // peer-to-peer copy to the drafter's GPU
              DFLASH_CUDA_CHECK(cudaSetDevice(dr.device));
              local = cuda::StreamBuffer<bf16>(size_t(m.elems), dr.stream.s);
              DFLASH_CUDA_CHECK(cudaMemcpyPeerAsync(local.data(), dr.device, taps, m.pack->device,
                                                    size_t(m.elems) * sizeof(bf16), dr.stream.s));
              taps = local.data();
            }
            res[j] = dr.step(taps, *mbs[j].sample, mbs[j].anchors, loss, opt_.recompute);  // (synchronizes)
            res[j].target_ms = m.target_ms, res[j].queue_ms = wait_ms;
          }
        }
      } catch (const Cancelled&) {
        hand.cancel();  // another worker failed first; its error is reported
      } catch (...) {
        err[j] = std::current_exception();
        hand.cancel();
      }
    });
    if (opt_.pg.world > 1) exchange(mbs, &res, err);
    for (size_t j = 0; j < n; ++j)
      if (err[j]) try {
          std::rethrow_exception(err[j]);
        } catch (const std::exception& e) {
          throw std::runtime_error("training example " + std::to_string(mbs[j].sample->index) + ": " + e.what());
        }
    return res;
  }

  /// Several processes: every process learns every micro-batch's result (an NCCL all-reduce of
  /// [done, loss, weight sum, times, error rank + 1, slot counts] per micro-batch; each process fills
  /// its own). A micro-batch that failed elsewhere throws here too, so that all processes stop.
  void exchange(const std::vector<MicroBatch>& mbs, std::vector<MicroResult>* res, const std::vector<std::exception_ptr>& err) {
    const size_t n = mbs.size(), B = size_t(cfg_.block_size), m = 8 + 2 * B;
    std::vector<double> h(n * m, 0.0);
    for (size_t j = 0; j < n; ++j) {
      const MicroResult& r = (*res)[j];
      double* e = h.data() + j * m;
      if (err[j]) {
        e[6] = opt_.pg.rank + 1;
        continue;
      }
      if (r.slot_count.size() != B) continue;  // not this process's
      e[0] = 1, e[1] = r.loss, e[2] = r.weight_sum, e[3] = r.target_ms, e[4] = r.drafter_ms, e[5] = r.queue_ms;
      for (size_t k = 0; k < B; ++k) e[7 + k] = double(r.slot_correct[k]), e[7 + B + k] = double(r.slot_count[k]);
      e[7 + 2 * B] = r.nonfinite_taps;
    }
    all_reduce(&h, ncclFloat64, ncclSum);
    bool local_error = false;
    for (const auto& e : err) local_error = local_error || bool(e);
    if (local_error) return;  // the caller reports this process's own error
    for (size_t j = 0; j < n; ++j)
      if (h[j * m + 6] > 0)
        throw std::runtime_error("training example " + std::to_string(mbs[j].sample->index) + " failed in process " +
                                 std::to_string(int(h[j * m + 6]) - 1) + " (its output says why)");
    for (size_t j = 0; j < n; ++j) {
      const double* e = h.data() + j * m;
      if (e[0] != 1) throw std::runtime_error("multi-process exchange: micro-batch " + std::to_string(j) + " ran " +
                                              std::to_string(e[0]) + " times");
      MicroResult& r = (*res)[j];
      r.loss = e[1], r.weight_sum = e[2], r.target_ms = e[3], r.drafter_ms = e[4], r.queue_ms = e[5];
      r.slot_correct.assign(B, 0), r.slot_count.assign(B, 0);
      for (size_t k = 0; k < B; ++k) r.slot_correct[k] = int64_t(e[7 + k]), r.slot_count[k] = int64_t(e[7 + B + k]);
      r.nonfinite_taps = e[7 + 2 * B] > 0;
    }
  }

  bool any_rank(bool local) override {
    if (opt_.pg.world <= 1) return local;
    std::vector<double> v = {local ? 1.0 : 0.0};
    all_reduce(&v, ncclFloat64, ncclMax);
    return v[0] > 0;
  }

  void scale_grads(double f) override {
    on_drafters([&](DrafterReplica& r) { r.drafter.scale_grads(float(f)); });
  }

  ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) override {
    if (!comms_.empty()) {
      DFLASH_NCCL_CHECK(ncclGroupStart());
      for (size_t i = 0; i < drafters_.size(); ++i) {
        DrafterReplica& r = *drafters_[i];
        DFLASH_CUDA_CHECK(cudaSetDevice(r.device));
        DFLASH_NCCL_CHECK(ncclAllReduce(r.drafter.grad_data(), r.drafter.grad_data(), size_t(r.drafter.num_params()),
                                        ncclFloat32, ncclSum, comms_[i], r.stream.s));
      }
      DFLASH_NCCL_CHECK(ncclGroupEnd());
    }
    std::vector<ClipResult> r(drafters_.size());
    on_threads(drafters_.size(), [&](size_t i) {
      DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[i]->device));
      r[i] = drafters_[i]->drafter.optimizer_step(o, lr, max_norm, t);
    });
    return r[0];
  }

  OptimizerState state() const override {
    DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[0]->device));
    OptimizerState st;
    st.weights = drafters_[0]->drafter.weights();
    drafters_[0]->drafter.moments(&st.exp_avg, &st.exp_avg_sq);
    return st;
  }

  void set_state(const OptimizerState& s) override {
    on_drafters([&](DrafterReplica& r) { r.drafter.set_state(s.weights, s.exp_avg, s.exp_avg_sq); });
  }

  /// (The gradients are the all-reduced sum after optimizer_step: replica 0 has them all.)
  std::string first_nonfinite_grad() const override {
    DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[0]->device));
    return first_nonfinite(drafters_[0]->drafter.grads());
  }

  std::string device() const override {
    auto list = [](const auto& reps) {
      std::string r;
      for (size_t i = 0; i < reps.size(); ++i) r += (i ? "," : "") + std::to_string(reps[i]->device);
      return r;
    };
    const std::string t = list(targets_), d = list(drafters_);
    const std::string where = t == d ? "cuda:" + d : "target cuda:" + t + " / drafter cuda:" + d;
    return opt_.pg.world > 1 ? where + " in each of " + std::to_string(opt_.pg.world) + " processes" : where;
  }

 private:
  /// Element-wise reduction of `h` over the processes: drafter replica 0 of each process brings `h`,
  /// the other local replicas (ranks of the same communicator) bring the identity (0: sum and max
  /// of non-negative values), and `h` becomes the result.
  void all_reduce(std::vector<double>* h, ncclDataType_t type, ncclRedOp_t op) {
    std::vector<cuda::DeviceArray<double>> buf;
    for (size_t i = 0; i < drafters_.size(); ++i) {
      DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[i]->device));
      buf.emplace_back(h->size());
      if (i == 0)
        DFLASH_CUDA_CHECK(cudaMemcpyAsync(buf[i].data(), h->data(), h->size() * 8, cudaMemcpyHostToDevice, drafters_[i]->stream.s));
      else
        DFLASH_CUDA_CHECK(cudaMemsetAsync(buf[i].data(), 0, h->size() * 8, drafters_[i]->stream.s));
    }
    DFLASH_NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < drafters_.size(); ++i) {
      DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[i]->device));
      DFLASH_NCCL_CHECK(ncclAllReduce(buf[i].data(), buf[i].data(), h->size(), type, op, comms_[i], drafters_[i]->stream.s));
    }
    DFLASH_NCCL_CHECK(ncclGroupEnd());
    DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[0]->device));
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(h->data(), buf[0].data(), h->size() * 8, cudaMemcpyDeviceToHost, drafters_[0]->stream.s));
    for (size_t i = 0; i < drafters_.size(); ++i) {
      DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[i]->device));
      DFLASH_CUDA_CHECK(cudaStreamSynchronize(drafters_[i]->stream.s));
      buf[i] = cuda::DeviceArray<double>();
    }
  }

  void on_drafters(const std::function<void(DrafterReplica&)>& fn) {
    on_threads(drafters_.size(), [&](size_t i) {
      DFLASH_CUDA_CHECK(cudaSetDevice(drafters_[i]->device));
      fn(*drafters_[i]);
    });
  }

  DrafterConfig cfg_;
  GpuTrainOptions opt_;
  std::vector<std::unique_ptr<TargetReplica>> targets_;
  std::vector<std::unique_ptr<DrafterReplica>> drafters_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const GpuReplicaFactory& f,
                                                 const std::vector<int>& target_devices,
                                                 const std::vector<int>& drafter_devices, const GpuTrainOptions& opt) {
  if (target_devices.empty() || drafter_devices.empty())
    throw std::invalid_argument("make_gpu_backend: no target GPU or no drafter GPU given");
  for (const auto* l : {&target_devices, &drafter_devices})
    for (size_t i = 0; i < l->size(); ++i)
      if (std::count(l->begin(), l->end(), (*l)[i]) > 1)
        throw std::invalid_argument("make_gpu_backend: GPU " + std::to_string((*l)[i]) + " listed twice");
  if (target_devices.size() == 1 && target_devices == drafter_devices && opt.pg.world == 1)
    return std::make_unique<GpuBackend>(cfg, f, target_devices[0], opt);
  return std::make_unique<MultiGpuBackend>(cfg, f, target_devices, drafter_devices, opt);
}

std::unique_ptr<DrafterBackend> make_gpu_backend(const DrafterConfig& cfg, const DrafterWeights<float>& weights,
                                                 const TargetModel& target, const std::vector<int>& target_devices,
                                                 const std::vector<int>& drafter_devices, const GpuTrainOptions& opt) {
  GpuReplicaFactory f;
  f.target = [&](cudaStream_t s) { return std::make_unique<TargetGpu>(target, s, opt.target_dtype); };
  f.drafter = [&](cudaStream_t s) {
    return std::make_unique<DrafterGpu>(cfg, weights, target.embed_tokens(), target.lm_head(), s);
  };
  return make_gpu_backend(cfg, f, target_devices, drafter_devices, opt);
}

}  // namespace dflash
