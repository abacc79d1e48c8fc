// Keys / values of decoding caches on the GPU (the target's attention layers, the drafter's context),
// one region of `cap` rows per sequence, grown by doubling.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "gpu/runtime.h"

namespace dflash {

/// Keys / values of `k.size()` layers for n sequences x cap tokens: layer l's keys [n, cap, row]
/// bf16 (row = Hkv * head_dim), sequence q's token j at row q * cap + j; len[q] tokens are valid.
struct KvCache {
  int n = 0;
  int64_t cap = 0, row = 0;
  std::vector<int64_t> len;
  std::vector<cuda::DeviceArray<cuda::bf16>> k, v;

  /// Empty cache of n sequences, `layers` layers of rows of `row` elements (nothing allocated yet).
  KvCache(int n_seq = 0, int64_t layers = 0, int64_t row_elems = 0)
      : n(n_seq), row(row_elems), len(size_t(n_seq), 0), k(size_t(layers)), v(size_t(layers)) {}

  /// Makes room for `need` tokens per sequence (capacity doubles; rows are copied over). Throws
  /// std::runtime_error on out of memory, leaving the cache as it was.
  void reserve(int64_t need, cudaStream_t s) {
    if (need <= cap) return;
    const int64_t ncap = std::max<int64_t>({need, 2 * cap, 256});
    // All new buffers first: out of memory leaves the cache as it was.
    std::vector<cuda::DeviceArray<cuda::bf16>> nk(k.size()), nv(v.size());
    for (auto* layer : {&nk, &nv})
      for (cuda::DeviceArray<cuda::bf16>& b : *layer) b = cuda::DeviceArray<cuda::bf16>(size_t(n * ncap * row));
    for (size_t i = 0; cap && i < k.size(); ++i)
      for (auto [from, to] : {std::pair{&k[i], &nk[i]}, std::pair{&v[i], &nv[i]}})
        DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(to->data(), size_t(ncap * row) * 2, from->data(), size_t(cap * row) * 2,
                                            size_t(cap * row) * 2, size_t(n), cudaMemcpyDeviceToDevice, s));
    k = std::move(nk);  // the stream-ordered copies finish before the old buffers' cudaFree returns
    v = std::move(nv);
    cap = ncap;
  }
};

}  // namespace dflash
