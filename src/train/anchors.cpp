#include "train/anchors.h"

#include <algorithm>
#include <stdexcept>

namespace dflash {

uint64_t uniform_below(uint64_t n, std::mt19937_64& rng) {
  if (n == 0) throw std::invalid_argument("uniform_below: n must be > 0");
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;  // largest multiple of n, exclusive
  uint64_t x;
  do x = rng();
  while (x >= limit);
  return x % n;
}

std::vector<int64_t> anchor_candidates(std::span<const uint8_t> loss_mask) {
  std::vector<int64_t> c;
  for (size_t p = 0; p + 1 < loss_mask.size(); ++p)
    if (loss_mask[p] && loss_mask[p + 1]) c.push_back(int64_t(p));
  return c;
}

std::vector<int64_t> sample_anchors(std::span<const uint8_t> loss_mask, int64_t num_anchors, std::mt19937_64& rng) {
  if (num_anchors < 0) throw std::invalid_argument("sample_anchors: num_anchors must be >= 0");
  std::vector<int64_t> c = anchor_candidates(loss_mask);
  const size_t k = std::min(c.size(), size_t(num_anchors));
  for (size_t i = 0; i < k; ++i)  // partial Fisher-Yates: c[0..k) is a uniform sample
    std::swap(c[i], c[i + size_t(uniform_below(c.size() - i, rng))]);
  c.resize(k);
  std::sort(c.begin(), c.end());
  return c;
}

}  // namespace dflash
