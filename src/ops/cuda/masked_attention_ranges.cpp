// Host-side helpers of the GPU masked attention: mask ranges in the kernels' int32 form.
#include <climits>
#include <stdexcept>

#include "ops/cuda/masked_attention.h"
#include "ops/dflash_attention.h"

namespace dflash::cuda {

std::vector<KvRange32> to_kv_range32(const std::vector<cpu::KvRanges>& r) {
  std::vector<KvRange32> out(r.size());
  for (size_t i = 0; i < r.size(); ++i) {
    for (int64_t x : {r[i].ctx_begin, r[i].ctx_end, r[i].blk_begin, r[i].blk_end})
      if (x < INT_MIN || x > INT_MAX / 2) throw std::invalid_argument("to_kv_range32: range does not fit int32");
    out[i] = {int32_t(r[i].ctx_begin), int32_t(r[i].ctx_end), int32_t(r[i].blk_begin), int32_t(r[i].blk_end)};
  }
  return out;
}

std::vector<KvRange32> causal_ranges(const std::vector<int64_t>& cu) {
  if (cu.empty() || cu[0] != 0) throw std::invalid_argument("causal_ranges: cu_seqlens must start at 0");
  std::vector<KvRange32> out;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s + 1] < cu[s] || cu[s + 1] > INT_MAX / 2) throw std::invalid_argument("causal_ranges: bad cu_seqlens");
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) out.push_back({int32_t(cu[s]), int32_t(t + 1), 0, 0});
  }
  return out;
}

}  // namespace dflash::cuda
