// The RoPE parameters of a model (config.json's rope_theta, rope_scaling, partial_rotary_factor as
// transformers reads them): what the RoPE ops take and ModelSpec holds.
#pragma once
#include <cstdint>
#include <string>

namespace dflash {

/// RoPE frequency scheme (transformers modeling_rope_utils.py): "default", "llama3" or "yarn".
struct RopeSpec {
  std::string type = "default";
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;  // fraction of head_dim that rotates (Qwen3.5: 0.25)
  // scaling (rope_type "llama3" and "yarn"): the context factor and the pretrained context length
  double factor = 1.0;
  int64_t original_max_position_embeddings = 8192;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  // yarn: the ramp's rotation bounds, the cos / sin scale (attention_factor; 0 = derived from factor,
  // mscale and mscale_all_dim as transformers does) and whether the ramp bounds are rounded (truncate)
  double beta_fast = 32.0, beta_slow = 1.0, attention_factor = 0.0, mscale = 0.0, mscale_all_dim = 0.0;
  bool truncate = true;
};

}  // namespace dflash
