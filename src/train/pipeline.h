// The host-side scheduling of the multi-replica training pipeline (src/train/cuda/gpu_backend.cpp),
// kept free of CUDA so that it is unit-tested (and run under sanitizers) on any machine: which
// replica gets which micro-batch, how a target replica packs its micro-batches into forwards, the
// bounded queues between target and drafter replicas, and a thread per replica.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "train/backend.h"

namespace dflash {

/// Runs of consecutive `items` (micro-batch indices, increasing) whose samples add up to at most
/// `budget` tokens (a longer sample forms a run alone): the packed target forwards.
std::vector<std::vector<size_t>> pack_runs(const std::vector<size_t>& items, const std::vector<MicroBatch>& mbs,
                                           int64_t budget);

/// The replica of each micro-batch, balanced by tokens: longest first to the replica with the fewest
/// tokens so far (ties: the lower index), so the result depends only on the lengths.
std::vector<size_t> balance(const std::vector<MicroBatch>& mbs, size_t replicas);

/// fn(i) for i in [0, n) on n threads at once; rethrows the exception of the lowest failing i.
void on_threads(size_t n, const std::function<void(size_t)>& fn);

/// Thrown in a worker when another worker failed and the step is being abandoned.
struct Cancelled {};

/// FIFO queues of `Msg` between every (target replica, drafter replica) pair, `cap` messages each.
/// Target t sends its micro-batches in increasing index order and drafter d takes its own in
/// increasing order, so each pair's queue is consumed in the order it is filled (deterministic
/// accumulation order), and the smallest unconsumed micro-batch can always move (no deadlock).
/// push / pop block; after cancel() they throw Cancelled.
template <typename Msg>
class Handoff {
 public:
  Handoff(size_t nt, size_t nd, size_t cap) : nd_(nd), cap_(cap), q_(nt * nd) {}
  void push(size_t t, size_t d, Msg m) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return cancelled_ || q_[t * nd_ + d].size() < cap_; });
    if (cancelled_) throw Cancelled{};
    q_[t * nd_ + d].push_back(std::move(m));
    cv_.notify_all();
  }
  Msg pop(size_t t, size_t d) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return cancelled_ || !q_[t * nd_ + d].empty(); });
    if (cancelled_) throw Cancelled{};
    Msg m = std::move(q_[t * nd_ + d].front());
    q_[t * nd_ + d].pop_front();
    cv_.notify_all();
    return m;
  }
  void cancel() {
    std::lock_guard<std::mutex> l(mu_);
    cancelled_ = true;
    cv_.notify_all();
  }

 private:
  size_t nd_, cap_;
  std::vector<std::deque<Msg>> q_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool cancelled_ = false;
};

}  // namespace dflash
