// A `llama` GGUF model (io/gguf.h reads the file) as the engine sees it: its ModelSpec from the GGUF
// metadata and its tensors under Hugging Face names, in Hugging Face row order (llama.cpp's
// convert_hf_to_gguf.py mapping, undone).
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/gguf.h"
#include "io/weights.h"
#include "models/model_spec.h"
#include "tensor/tensor.h"

namespace dflash {

/// Architectures gguf_model_spec / GGUFWeights understand (general.architecture values).
std::vector<std::string> gguf_supported_architectures();

/// ModelSpec of a GGUF model. Supported: general.architecture == "llama" (dense; no MoE, no RoPE
/// scaling). Reads llama.{embedding_length, feed_forward_length, block_count, context_length,
/// attention.head_count, attention.head_count_kv (default head_count),
/// attention.layer_norm_rms_epsilon, attention.key_length (default hidden/heads),
/// rope.freq_base (default 10000), vocab_size (default: length of tokenizer.ggml.tokens)} and
/// tokenizer.ggml.{bos,eos}_token_id. tie_word_embeddings is true iff there is no output.weight.
/// Throws std::runtime_error naming the path (and key) for other architectures (listing the
/// supported ones), missing/ill-typed keys, or shapes inconsistent with token_embd.weight.
/// Does not call ModelSpec::validate (callers do).
ModelSpec gguf_model_spec(const GGUFFile& file);

/// Hugging Face name of a llama GGUF tensor ("blk.3.attn_q.weight" ->
/// "model.layers.3.self_attn.q_proj.weight"); names without a mapping are returned unchanged.
std::string gguf_llama_hf_name(const std::string& gguf_name);

/// Inverse of llama.cpp's convert_hf_to_gguf.py LlamaModel.permute on the rows of a q_proj /
/// k_proj weight [n_head * head_dim, ...] (or bias [n_head * head_dim]): GGUF row
/// h*hd + 2*i + s holds HF row h*hd + s*hd/2 + i. Throws std::runtime_error (prefixed by `what`)
/// if the row count is not a multiple of 2 * n_head.
void gguf_unpermute_qk_rows(Tensor& w, int64_t n_head, const std::string& what);

/// A llama GGUF file as a WeightSource under Hugging Face names (see gguf_llama_hf_name).
/// load_f32 dequantizes to float32 and, for q_proj / k_proj, undoes llama.cpp's RoPE row
/// permutation (n_head for q, n_head_kv for k) so rows come back in HF order.
/// info(): dtype F32, storage = ggml type name, shape in PyTorch order, file "path (TYPE)".
class GGUFWeights : public WeightSource {
 public:
  /// Opens the file; throws std::runtime_error as GGUFFile and gguf_model_spec do, or when two
  /// GGUF tensors map to the same HF name.
  explicit GGUFWeights(const std::string& path);
  explicit GGUFWeights(std::shared_ptr<const GGUFFile> file);

  std::vector<std::string> names() const override;
  bool has(const std::string& name) const override;
  TensorInfo info(const std::string& name) const override;
  Tensor load_f32(const std::string& name) const override;
  std::string origin() const override { return file_->path(); }

  const GGUFFile& file() const { return *file_; }
  const ModelSpec& spec() const { return spec_; }
  /// GGUF name behind an HF name; throws std::runtime_error if absent.
  const std::string& gguf_name(const std::string& hf_name) const;

 private:
  std::shared_ptr<const GGUFFile> file_;
  ModelSpec spec_;
  std::unordered_map<std::string, std::string> hf_to_gguf_;
  std::vector<std::string> names_;  // sorted HF names
};

}  // namespace dflash
