// Checkpoints stored in FP8 (E4M3), as transformers and its quantizers write them, read as float32.
//
// config.json's quantization_config names the format:
//  - {"quant_method": "fp8", "weight_block_size": [bn, bk]} (transformers FineGrainedFP8,
//    integrations/finegrained_fp8.py): `<m>.weight` F8_E4M3 [N, K] and `<m>.weight_scale_inv` F32
//    [ceil(N / bn), ceil(K / bk)]; weight[n, k] = q[n, k] * weight_scale_inv[n / bn, k / bk];
//  - {"quant_method": "fp8"} without a block size, or "fbgemm_fp8" (integrations/fbgemm_fp8.py):
//    `<m>.weight_scale` F32 [N, 1], [N] (one per output channel) or [] / [1] (one per tensor);
//    weight[n, k] = q[n, k] * weight_scale[n].
// Activation scales stored beside them (`<m>.input_scale`, "activation_scheme": "static") are not
// used: the GPU FP8 path quantizes activations per token, dynamically (ops/cuda/fp8.h).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "io/weights.h"

namespace dflash {

/// How a checkpoint's FP8 weights are scaled: by blocks of block_n x block_k (both > 0), or (both 0)
/// per output channel or per tensor, as the scale tensor's shape says.
struct Fp8Format {
  std::string quant_method;  // "fp8" or "fbgemm_fp8"
  int64_t block_n = 0, block_k = 0;
};

/// The FP8 format config.json (`cfg`, read from `where`) declares in quantization_config; nullopt
/// when it has none. Throws std::runtime_error naming `where` for another quant_method (only fp8 and
/// fbgemm_fp8 are read) or a weight_block_size that is not two positive integers.
std::optional<Fp8Format> read_fp8_format(const nlohmann::json& cfg, const std::string& where);

/// `inner` with every F8_E4M3 tensor dequantized by its scale tensor (Fp8Format) when loaded; the
/// scale tensors (`.weight_scale_inv`, `.weight_scale`, `.input_scale`) are hidden from names() /
/// has(). info() of an F8 tensor says dtype F32, storage "F8_E4M3". load_f32 throws
/// std::runtime_error naming the file and tensor for an F8 tensor without its scale, or a scale of
/// the wrong shape; with no format (nullopt) every F8 tensor is such an error (FP8 bytes without
/// scales are not the weights).
std::unique_ptr<WeightSource> fp8_dequantizing(std::unique_ptr<WeightSource> inner, std::optional<Fp8Format> format);

}  // namespace dflash
