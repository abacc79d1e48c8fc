// A frozen target LLM on the CPU: weights in float32 and the reference forward pass
// (transformers' LlamaForCausalLM / Qwen3ForCausalLM / Qwen3_5ForCausalLM semantics).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/weights.h"
#include "models/model_spec.h"
#include "models/target_dtype.h"
#include "tensor/tensor.h"

namespace dflash {

/// Softmax attention weights (HF names under layers.{i}.self_attn.*). q_proj has 2*H*Dh rows when
/// the architecture has an output gate (Qwen3.5: per head [query Dh | gate Dh]).
struct AttentionWeights {
  Tensor q_proj, k_proj, v_proj, o_proj;  // [out, in]
  Tensor q_norm, k_norm;                  // [Dh], empty for Llama
};

/// Qwen3.5 GatedDeltaNet weights (HF names under layers.{i}.linear_attn.*).
struct GatedDeltaNetWeights {
  Tensor in_proj_qkv;  // [2*Hk*dk + Hv*dv, D]
  Tensor in_proj_z;    // [Hv*dv, D]
  Tensor in_proj_b;    // [Hv, D]
  Tensor in_proj_a;    // [Hv, D]
  Tensor conv1d;       // [C, K] (stored [C, 1, K])
  Tensor A_log;        // [Hv]
  Tensor dt_bias;      // [Hv]
  Tensor norm;         // [dv], plain weight
  Tensor out_proj;     // [D, Hv*dv]
};

struct MlpWeights {
  Tensor gate_proj, up_proj;  // [I, D]
  Tensor down_proj;           // [D, I]
};

/// Mixture-of-experts FFN (transformers Qwen2MoeSparseMoeBlock, used by Qwen3-Next and Qwen3.5-MoE;
/// HF names under layers.{i}.mlp.*). E experts of size Im, shared expert of size Is.
struct MoeWeights {
  Tensor router;                // gate.weight [E, D]
  std::vector<Tensor> gate_up;  // per expert [2*Im, D]: rows [0, Im) gate, [Im, 2*Im) up
  std::vector<Tensor> down;     // per expert [D, Im]
  MlpWeights shared;            // shared_expert (empty when Is == 0)
  Tensor shared_gate;           // shared_expert_gate.weight [1, D]
};

struct LayerWeights {
  LayerKind kind = LayerKind::Attention;
  Tensor input_layernorm, post_attention_layernorm;  // [D]
  AttentionWeights attn;
  GatedDeltaNetWeights gdn;
  bool moe_layer = false;  // the FFN is `moe` (else `mlp`)
  MlpWeights mlp;
  MoeWeights moe;
};

/// What a forward call returns. `hidden_states` uses transformers' numbering: 0 = embeddings,
/// j = output of layer j - 1, and j = L (num_hidden_layers) is after the final norm.
struct ForwardOutput {
  Tensor logits;                          // [T, V] float32, empty unless requested
  std::map<int, Tensor> hidden_states;    // j -> [T, D] float32
};

struct ForwardOptions {
  bool logits = true;
  /// Hidden-state indices to return (0..L). Without logits, layers past the deepest requested one
  /// are not computed (training needs only the taps).
  std::vector<int> hidden_states;
  /// With a cache: keep what TargetCache::rollback needs to drop tokens of this forward again
  /// (GatedDeltaNet states after each token: n x Hv x dk x dv floats per layer; speculative verify).
  bool keep_rollback = false;
};

/// Decoding state of a batch of sequences: transformers' DynamicCache (attention keys / values after
/// q/k norm and RoPE) plus Qwen3.5's GatedDeltaNet conv window and recurrent state, per sequence and
/// layer (only the member of a layer's kind is used). TargetModel::forward with a cache appends to it.
struct TargetCache {
  struct Layer {
    Tensor k, v;       // attention: [length, Hkv, Dh]
    Tensor window;     // GatedDeltaNet: [K-1, C] the last K-1 conv inputs (zeros before the start)
    Tensor state;      // GatedDeltaNet: [Hv, dk, dv] recurrent state (fp32)
    Tensor window_hist, state_hist;  // keep_rollback: [K-1 + n, C] and [n + 1, Hv, dk, dv] of the last forward
  };
  struct Seq {
    int64_t length = 0;
    int64_t rollback_from = -1;  // length before the last forward run with keep_rollback (-1: none)
    std::vector<Layer> layers;
  };
  std::vector<Seq> seqs;

  /// Empty state for `n_seq` sequences of model `s`.
  TargetCache(const ModelSpec& s, int n_seq);
  int num_seqs() const { return int(seqs.size()); }
  int64_t length(int s) const { return seqs.at(size_t(s)).length; }
  /// Keeps the first `length` tokens of sequence s (speculative decoding's rollback to the commit
  /// point). Attention layers truncate their keys / values. GatedDeltaNet layers restore the conv
  /// window and recurrent state saved after token `length` of the last forward, which must have run
  /// with keep_rollback and begun at or before `length`. Throws std::invalid_argument otherwise.
  void rollback(int s, int64_t length);
  /// Empties sequence s (length 0, zero states).
  void clear(int s);

 private:
  Seq empty_;  // an empty sequence of this model
};

/// Hidden-state indices of DFlash taps: tap layer id i is hidden_states[i + 1] (dflash.md).
std::vector<int> tap_hidden_states(const std::vector<int64_t>& tap_layer_ids);
/// The taps of `f` (which holds tap_hidden_states(tap_layer_ids)) concatenated along features:
/// [T, K*D], tap k in columns [k*D, (k+1)*D).
Tensor concat_taps(const ForwardOutput& f, const std::vector<int64_t>& tap_layer_ids);

/// Per-layer kernel that runs on a device, for `dflash inspect`.
struct KernelChoice {
  std::string device;  // "cpu", "cuda"
  std::string kernel;  // empty: no kernel on this device (the engine refuses to run there)
  std::string refused_because;  // why, when kernel is empty
};

class TargetModel {
 public:
  /// Loads MODEL: a checkpoint directory (config.json + safetensors, single or sharded) or a .gguf
  /// file. Every tensor's presence and shape is checked; errors name the file and the tensor.
  static std::unique_ptr<TargetModel> load(const std::string& path);
  /// Builds from an already opened weight source and spec (tests, tools).
  static std::unique_ptr<TargetModel> from_weights(const ModelSpec& spec, const WeightSource& src);

  const ModelSpec& spec() const { return spec_; }

  /// Reference forward over a packed batch: `ids` [T] holds the sequences back to back,
  /// cu_seqlens [n + 1] their boundaries (positions restart at 0 in each sequence; attention,
  /// conv windows and recurrent states never cross a boundary). Thread-safe (const).
  /// Throws std::invalid_argument for bad ids, cu_seqlens or hidden-state indices.
  /// With `cache` (decoding): sequence s of cu_seqlens continues cache sequence s (cu_seqlens has
  /// cache->num_seqs() + 1 entries; a sequence may get no tokens), its positions starting at
  /// cache->length(s); every layer runs (opt.logits must be set) and the cache grows by the tokens.
  ForwardOutput forward(const std::vector<int32_t>& ids, const std::vector<int64_t>& cu_seqlens,
                        const ForwardOptions& opt, TargetCache* cache = nullptr) const;

  // Weights (float32 host), for the GPU backend's upload.
  const std::vector<LayerWeights>& layers() const { return layers_; }
  const Tensor& embed_tokens() const { return embed_tokens_; }
  const Tensor& final_norm() const { return norm_; }
  /// lm_head [V, D] (embed_tokens when tied).
  const Tensor& lm_head() const { return lm_head_.numel() ? lm_head_ : embed_tokens_; }
  /// RoPE inverse frequencies [rotary_dim / 2] (float32, as transformers computes them).
  const std::vector<float>& inv_freq() const { return inv_freq_; }

 private:
  TargetModel() = default;

  ModelSpec spec_;
  Tensor embed_tokens_;  // [V, D]
  Tensor norm_;          // [D]
  Tensor lm_head_;       // [V, D]; empty when tied (embed_tokens_ is used)
  std::vector<LayerWeights> layers_;
  std::vector<float> inv_freq_;
};

/// Kernels that run layer `layer` of model `s` (its mixer, and its FFN when that is a mixture of
/// experts) on each device of this build (reference on CPU; with CUDA, the GPU kernels or the reason
/// the GPU backend refuses the model).
/// dtype: how the GPU's projections compute (the CPU reference is always fp32).
std::vector<KernelChoice> layer_kernels(const ModelSpec& s, int64_t layer, TargetDtype dtype = TargetDtype::kBf16);
/// The "cuda" entry of layer_kernels: the GPU kernels, or the reason the GPU backend refuses the model
/// (src/models/cuda; a CPU-only build has none to give).
KernelChoice gpu_layer_kernel(const ModelSpec& s, int64_t layer, TargetDtype dtype);

/// Why the GPU backend cannot run model `s` ("" when it can): attention head_dim outside {64, 128,
/// 256}, an odd rotary dimension, GatedDeltaNet head dims above 128 or a conv kernel above 8;
/// mixture-of-experts widths not multiples of 8, more than 1024 experts or 32 per token.
std::string gpu_unsupported_reason(const ModelSpec& s);

/// Opens the weights of MODEL (directory or .gguf) and reads its spec, without loading tensors.
struct OpenedModel {
  ModelSpec spec;
  std::unique_ptr<WeightSource> weights;
  std::string format;  // "safetensors" (with how FP8 weights were scaled, for such a checkpoint) or "gguf"
};
OpenedModel open_model(const std::string& path);

/// Experts of `prefix` ("...layers.{i}.mlp."): experts.gate_up_proj [E, 2*Im, D] and
/// experts.down_proj [E, D, Im] (transformers 5 layout), or per expert experts.{e}.gate_proj /
/// up_proj [Im, D] and down_proj [D, Im] (the Hub checkpoints' layout). Throws std::runtime_error
/// naming the file and tensor on a missing tensor or a wrong shape.
MoeWeights load_moe_weights(const ModelSpec& s, const WeightSource& src, const std::string& prefix);
/// The router's choice per token: ids [T * k] (expert of token t's j-th pick at t * k + j, the most
/// likely first) and their weights [T * k].
struct MoeRouting {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
/// Router of logits [T, E] (fp32): softmax over the experts (in double), the k most likely (lower
/// index first on ties), weights = their probabilities, renormalized to sum 1 when norm_topk_prob
/// (transformers Qwen2MoeTopKRouter). Throws std::invalid_argument for k outside 1..E and
/// std::runtime_error naming the token and expert of a non-finite logit.
MoeRouting moe_route(const Tensor& logits, int64_t k, bool norm_topk_prob);
/// The mixture-of-experts FFN of x [T, D] -> [T, D] (fp32): router softmax, the top num_experts_per_tok
/// experts (renormalized when spec.norm_topk_prob), each down(silu(gate x) * up x) weighted by its
/// probability, plus sigmoid(shared_gate x) * shared_expert(x). Source: transformers
/// models/qwen2_moe/modular_qwen2_moe.py (Qwen2MoeTopKRouter, Qwen2MoeSparseMoeBlock), MixtralExperts.
Tensor moe_forward(const ModelSpec& s, const MoeWeights& w, const Tensor& x);

// Architecture pieces, one file each (src/models/*.cpp).
/// Loads attention weights of layer prefix `p` ("model.layers.3.") with shape checks.
AttentionWeights load_attention_weights(const ModelSpec& s, const WeightSource& src, const std::string& p);
/// Causal self-attention mixer, x [T, D] (after input_layernorm) -> [T, D]: q/k/v projections,
/// optional q/k norm (Qwen3, Qwen3.5 zero-centered), optional output gate (Qwen3.5), (partial) RoPE
/// at `positions`, GQA softmax attention within each sequence of cu_seqlens, o_proj. With `cache`
/// (layer `layer` of every sequence), keys / values are appended to it and queries also see its keys.
Tensor attention_forward(const ModelSpec& s, const AttentionWeights& w, const Tensor& x,
                         const std::vector<int64_t>& positions, const std::vector<float>& inv_freq,
                         const std::vector<int64_t>& cu_seqlens, TargetCache* cache = nullptr, int layer = 0,
                         bool keep_rollback = false);
/// Qwen3.5 GatedDeltaNet: loading and the reference mixer forward ([T, D] -> [T, D]).
GatedDeltaNetWeights load_gated_deltanet_weights(const ModelSpec& s, const WeightSource& src, const std::string& p);
/// With `cache`, each sequence continues from its conv window and recurrent state of layer `layer`,
/// which are updated (and, with keep_rollback, saved after every token).
Tensor gated_deltanet_forward(const ModelSpec& s, const GatedDeltaNetWeights& w, const Tensor& x,
                              const std::vector<int64_t>& cu_seqlens, TargetCache* cache = nullptr, int layer = 0,
                              bool keep_rollback = false);
/// Reads tensor `name` as float32, checks its shape (`stored` when the file keeps it in another
/// layout of the same data, e.g. conv1d [C, 1, K] read as [C, K]) and that every value is finite.
/// Throws std::runtime_error naming the file and the tensor.
Tensor load_checked(const WeightSource& src, const std::string& name, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& stored = {});

}  // namespace dflash
