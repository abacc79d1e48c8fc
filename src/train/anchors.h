// Anchor sampling for DFlash training (docs/dflash.md, "Training", step 2).
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace dflash {

/// Uniform integer in [0, n) from `rng` by rejection: unbiased and the same on every platform
/// (std::uniform_int_distribution is not). Throws std::invalid_argument for n == 0.
uint64_t uniform_below(uint64_t n, std::mt19937_64& rng);

/// Positions p with loss_mask[p] and loss_mask[p + 1] both set (an assistant token followed by
/// another): the places a block can start. Ascending.
std::vector<int64_t> anchor_candidates(std::span<const uint8_t> loss_mask);

/// Up to `num_anchors` candidates drawn uniformly without replacement, returned sorted ascending.
/// Fresh on every call; reproducible from `rng`'s state on every platform (no std distributions,
/// whose output differs between standard libraries). Throws std::invalid_argument for num_anchors < 0.
std::vector<int64_t> sample_anchors(std::span<const uint8_t> loss_mask, int64_t num_anchors, std::mt19937_64& rng);

}  // namespace dflash
