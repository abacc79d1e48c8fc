// Everything `dflash train` takes: defaults = the published recipe (docs/dflash.md
// "Training", step 6). Read from / written to JSON (the --config file and DIR/train_config.json).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace dflash {

struct TrainConfig {
  // what and where
  std::string target;              // checkpoint directory or .gguf
  std::vector<std::string> data;   // a prepared directory, or raw chat files (prepared into OUT/data)
  std::string out;                 // output directory: checkpoints, metrics, the resolved config
  std::string tokenizer;           // default: the target's own (directory or .gguf)
  std::string chat_template;       // raw data only; default: detected from the tokenizer
  std::string device = "cpu";      // "cpu" (reference) or "cuda"
  std::vector<int> gpus = {0};     // CUDA devices, colocated: a target + a drafter replica on each
  std::vector<int> target_gpus, drafter_gpus;  // disaggregated placement (both or neither; replace gpus)
  int64_t target_batch_tokens = 8192;          // GPU: a target forward packs samples up to this many tokens
  std::string target_dtype = "bf16";           // GPU: the target's projections in "bf16" or "fp8" (models/target_dtype.h)
  std::string init_from;           // a DFlash checkpoint to start from (z-lab / SpecForge / ours)
  // data
  int64_t max_length = 3072;
  bool shuffle = true;
  uint64_t seed = 0;
  // drafter
  /// "dflash", "dspark" (src/models/dspark.h), or "" (--init-from's kind, else dflash).
  std::string drafter_type;
  int64_t markov_rank = 256;              // DSpark's Markov head rank (published: 256)
  int64_t num_draft_layers = 5, num_taps = 5;
  int64_t block_size = 0;                 // 0: by the drafter (DFlash 16, DSpark 7)
  std::vector<int64_t> target_layer_ids;  // empty: the doc's default for num_taps
  std::optional<int64_t> mask_token_id;   // default: <|MASK|>, a spare row or an unused special token
  // drafter layout (unset: from the target as dflash.md says)
  std::vector<std::string> layer_types;   // one per draft layer, "full_attention" / "sliding_attention"
  int64_t sliding_window = 0;             // the sliding layers' window (tokens, self included)
  std::optional<int64_t> num_attention_heads, num_key_value_heads, head_dim, intermediate_size;
  nlohmann::json rope_scaling;            // null, or rope_scaling as transformers reads it (yarn, llama3)
  // optimization
  int64_t epochs = 6, max_steps = 0;      // max_steps > 0 overrides epochs
  int64_t grad_accum = 1, num_anchors = 512;
  bool recompute = false;                 // GPU: recompute each drafter layer in the backward (less memory)
  double lr = 6e-4, warmup_ratio = 0.04, weight_decay = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_grad_norm = 1.0;
  double gamma = 0;                       // 0: by block size (16 -> 7, 10 -> 5, 8 -> 4; DSpark: 4)
  std::string loss = "dflash";            // slot weights: "dflash" (the gamma decay) or "dpace" (D-PACE)
  // real acceptance during training (src/train/train_eval.h): held-out prompts decoded with the drafter
  std::vector<std::string> eval_data;     // prompt files (GSM8K, MT-Bench, messages, ShareGPT); empty: off
  int64_t eval_every = 0;                 // every N steps (0: only at the end), when eval_data is given
  int64_t eval_limit = 20;                // the first K conversations of each file
  int64_t eval_max_new_tokens = 128, eval_batch_size = 8;
  // operations
  int64_t save_every = 1000, keep_last = 3, log_every = 10, stages_every = 100, nan_abort = 10;
  int64_t steps_this_run = 0;             // > 0: checkpoint and exit after this many steps (time-sliced jobs)
  bool resume = false;

  /// Throws std::invalid_argument naming the field for values out of range or missing required ones.
  void validate() const;
  /// The range checks alone (what --dump-config checks).
  void validate_values() const;

  /// The GPUs of the target replicas / the drafter replicas (target_gpus / drafter_gpus, else gpus).
  const std::vector<int>& target_devices() const { return target_gpus.empty() ? gpus : target_gpus; }
  const std::vector<int>& drafter_devices() const { return drafter_gpus.empty() ? gpus : drafter_gpus; }
};

/// gamma of the loss decay for block size B: 7 for 16, 5 for 10, 4 for 8 (dflash.md), else 7 * B / 16.
double default_gamma(int64_t block_size);

/// Draft layer types from the compact form "sliding_attention x4,full_attention" (comma-separated,
/// "TYPE xN" repeats a type N times). Throws std::invalid_argument naming an unknown type or count.
std::vector<std::string> parse_layer_types(const std::string& s);

/// The configuration as JSON (every field).
nlohmann::json to_json(const TrainConfig& c);
/// Applies the fields present in `j` over `base`. Unknown keys and wrong types throw
/// std::runtime_error naming `where` and the key.
TrainConfig train_config_from_json(const nlohmann::json& j, const std::string& where, TrainConfig base = {});

}  // namespace dflash
