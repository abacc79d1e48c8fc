#include "train/pipeline.h"

#include <algorithm>
#include <exception>
#include <thread>

namespace dflash {

/// Runs of consecutive `items` (micro-batch indices, increasing) whose samples add up to at most
/// `budget` tokens (a longer sample forms a run alone): the packed target forwards.
std::vector<std::vector<size_t>> pack_runs(const std::vector<size_t>& items, const std::vector<MicroBatch>& mbs,
                                           int64_t budget) {
  std::vector<std::vector<size_t>> runs;
  int64_t tokens = 0;
  for (size_t j : items) {
    const int64_t n = int64_t(mbs[j].sample->ids.size());
    if (runs.empty() || tokens + n > budget) runs.emplace_back(), tokens = 0;
    runs.back().push_back(j);
    tokens += n;
  }
  return runs;
}

/// The replica of each micro-batch, balanced by tokens: longest first to the replica with the fewest
/// tokens so far (ties: the lower index), so the result depends only on the lengths.
std::vector<size_t> balance(const std::vector<MicroBatch>& mbs, size_t replicas) {
  std::vector<size_t> order(mbs.size()), rep(mbs.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return mbs[a].sample->ids.size() > mbs[b].sample->ids.size(); });
  std::vector<int64_t> load(replicas, 0);
  for (size_t j : order) {
    const size_t r = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    rep[j] = r;
    load[r] += int64_t(mbs[j].sample->ids.size());
  }
  return rep;
}

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

}  // namespace dflash
