#include "bench/presets.h"

#include <stdexcept>

#include "models/target.h"

namespace dflash {

namespace {

constexpr const char* kPresetNames = "qwen3-8b, qwen3.6-27b, qwen3.6-35b-a3b, tiny";

std::invalid_argument unknown_preset(const std::string& where, const std::string& name) {
  return std::invalid_argument(where + ": unknown preset '" + name + "' (" + kPresetNames + ")");
}

/// A dense Qwen3 target (q/k norm, plain RMSNorm, full RoPE, untied lm_head).
ModelSpec qwen3_spec(int64_t layers, int64_t D, int64_t I, int64_t H, int64_t Hkv, int64_t Dh, int64_t V) {
  ModelSpec s;
  s.arch = Arch::Qwen3;
  s.architecture = "Qwen3ForCausalLM";
  s.model_type = "qwen3";
  s.vocab_size = V, s.hidden_size = D, s.intermediate_size = I, s.num_hidden_layers = layers;
  s.num_attention_heads = H, s.num_key_value_heads = Hkv, s.head_dim = Dh;
  s.rms_norm_eps = 1e-6;
  s.rope.theta = 1e6;
  s.max_position_embeddings = 40960;
  s.layer_types.assign(size_t(layers), LayerKind::Attention);
  return s;
}

/// Qwen3.6-27B (docs/targets.md): 48 GatedDeltaNet + 16 gated attention layers.
ModelSpec qwen3_6_27b_spec() {
  ModelSpec s;
  s.arch = Arch::Qwen3_5;
  s.architecture = "Qwen3_5ForConditionalGeneration";
  s.model_type = "qwen3_5";
  s.weight_prefix = "model.language_model.";
  s.vocab_size = 248320, s.hidden_size = 5120, s.intermediate_size = 17408, s.num_hidden_layers = 64;
  s.num_attention_heads = 24, s.num_key_value_heads = 4, s.head_dim = 256;
  s.rms_norm_eps = 1e-6;
  s.rope.theta = 1e7, s.rope.partial_rotary_factor = 0.25;
  s.max_position_embeddings = 262144;
  s.linear_num_key_heads = 16, s.linear_num_value_heads = 48;
  s.linear_key_head_dim = 128, s.linear_value_head_dim = 128, s.linear_conv_kernel_dim = 4;
  for (int64_t i = 0; i < s.num_hidden_layers; ++i)
    s.layer_types.push_back((i + 1) % 4 == 0 ? LayerKind::Attention : LayerKind::GatedDeltaNet);
  return s;
}

/// Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B, transformers Qwen3_5MoeTextConfig's defaults): 30 GatedDeltaNet +
/// 10 gated attention layers, hidden 2048, every FFN a mixture of 256 experts (top 8, renormalized) of
/// width 512 plus a shared expert of 512.
ModelSpec qwen3_6_35b_a3b_spec() {
  ModelSpec s = qwen3_6_27b_spec();
  s.architecture = "Qwen3_5MoeForConditionalGeneration";
  s.model_type = "qwen3_5_moe";
  s.hidden_size = 2048, s.intermediate_size = 0, s.num_hidden_layers = 40;
  s.num_attention_heads = 16, s.num_key_value_heads = 2;
  s.linear_num_value_heads = 32;
  s.num_experts = 256, s.num_experts_per_tok = 8, s.moe_intermediate_size = 512, s.shared_expert_intermediate_size = 512;
  s.norm_topk_prob = true;
  s.layer_types.resize(size_t(s.num_hidden_layers));
  return s;
}

}  // namespace

DrafterBenchPreset drafter_bench_preset(const std::string& name, const std::string& where) {
  DrafterBenchPreset p;
  DrafterConfig& c = p.cfg;
  c.num_hidden_layers = 5, c.block_size = 16, c.head_dim = 128, c.num_attention_heads = 32, c.num_key_value_heads = 8;
  if (name == "qwen3-8b") {  // Qwen3-8B (docs/targets.md): d 4096, vocab 151936, S 3072
    c.hidden_size = 4096, c.intermediate_size = 12288, c.rope.theta = 1e6, c.num_target_layers = 36;
    p.V = 151936, p.S = 3072, c.mask_token_id = 151669;
  } else if (name == "qwen3.6-27b") {  // d 5120, vocab 248320, S 4096
    c.hidden_size = 5120, c.intermediate_size = 17408, c.rope.theta = 1e7, c.num_target_layers = 64;
    p.V = 248320, p.S = 4096, c.mask_token_id = 248070;
  } else if (name == "qwen3.6-35b-a3b") {  // d 2048 (intermediate 3 x hidden: the target has no dense MLP)
    c.hidden_size = 2048, c.intermediate_size = 6144, c.rope.theta = 1e7, c.num_target_layers = 40;
    c.num_attention_heads = 16, c.num_key_value_heads = 4;
    p.V = 248320, p.S = 4096, c.mask_token_id = 248070;
  } else if (name == "tiny") {  // smoke test of the command itself
    c.hidden_size = 256, c.intermediate_size = 512, c.num_attention_heads = 4, c.num_key_value_heads = 2;
    c.head_dim = 64, c.rope.theta = 1e6, c.num_target_layers = 8;
    p.V = 1000, p.S = 256, c.mask_token_id = 999;
  } else {
    throw unknown_preset(where, name);
  }
  c.vocab_size = p.V;
  c.target_layer_ids = default_target_layer_ids(c.num_target_layers, 5);
  c.layer_types.assign(size_t(c.num_hidden_layers), "full_attention");
  c.max_position_embeddings = 40960;
  return p;
}

PipelineBenchPreset pipeline_bench_preset(const std::string& name) {
  const std::string where = "bench pipeline";
  PipelineBenchPreset p;
  if (name == "qwen3-8b") p.target = qwen3_spec(36, 4096, 12288, 32, 8, 128, 151936);
  else if (name == "tiny") p.target = qwen3_spec(8, 256, 512, 4, 2, 64, 1000);
  else if (name == "qwen3.6-27b") p.target = qwen3_6_27b_spec();
  else if (name == "qwen3.6-35b-a3b") p.target = qwen3_6_35b_a3b_spec();
  else throw unknown_preset(where, name);
  p.target.validate(where + " --preset " + name);
  const std::string why = gpu_unsupported_reason(p.target);
  if (!why.empty())
    throw std::invalid_argument(where + " --preset " + name + ": the target cannot run on the GPU: " + why +
                                "; this preset runs once that kernel exists");
  p.drafter = drafter_bench_preset(name, where);
  return p;
}

}  // namespace dflash
