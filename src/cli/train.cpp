// `dflash train`: the main job. Flags override the --config file, which overrides the published
// recipe's defaults (src/train/train_config.h); the run itself is src/train/run.h.
#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <csignal>

#include "cli/commands.h"
#include "io/json_file.h"
#include "train/run.h"
#include "train/train_config.h"

namespace dflash::cli {

namespace {

std::atomic<int> g_stop{0};
/// First SIGINT / SIGTERM: finish the step, write a checkpoint, exit 128 + signal. A second one
/// quits at once (the default action).
void on_signal(int sig) {
  if (g_stop.exchange(sig) != 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

}  // namespace

void add_train(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("train", "Train a DFlash drafter for a target on chat data");
  static TrainConfig c;  // flag defaults = the recipe (shown by --help)
  static std::string config_file;
  static bool dump = false;
  static int64_t mask_id = -1;
  static std::string layer_types, rope_scaling;
  static int64_t heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  cmd->add_option("--config", config_file, "JSON file with any of the settings below (flags win)");
  cmd->add_flag("--dump-config", dump, "Print the resolved configuration as JSON and exit");
  cmd->add_option("--target", c.target, "Target model: checkpoint directory or .gguf");
  cmd->add_option("--data", c.data, "A directory made by dflash prepare, or chat files (JSONL / JSON)");
  cmd->add_option("--out", c.out, "Output directory (checkpoints, metrics.jsonl, train_config.json, final/)");
  cmd->add_option("--tokenizer", c.tokenizer, "Tokenizer (default: the target's)");
  cmd->add_option("--chat-template", c.chat_template, "Chat template family for raw data (default: detected)");
  cmd->add_option("--device", c.device, "cpu (reference) or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--gpus,--gpu", c.gpus,
                  "CUDA device(s), e.g. 0 or 0,1: several = data parallel (a target and a drafter replica on each, "
                  "gradients all-reduced with NCCL)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("--target-gpus", c.target_gpus,
                  "GPUs of the target replicas (with --drafter-gpus: disaggregated placement, taps copied peer to peer)")
      ->delimiter(',');
  cmd->add_option("--target-batch-tokens", c.target_batch_tokens,
                  "GPU: the target's forward packs consecutive samples (varlen) up to this many tokens")->capture_default_str();
  cmd->add_option("--target-dtype", c.target_dtype,
                  "GPU: the target's projections in bf16, or fp8 (E4M3, per-channel weight and per-token activation "
                  "scales; an FP8 checkpoint is read as well)")
      ->check(CLI::IsMember({"bf16", "fp8"}))->capture_default_str();
  cmd->add_option("--drafter-gpus", c.drafter_gpus, "GPUs of the drafter replicas (data parallel when several)")
      ->delimiter(',');
  cmd->add_option("--init-from", c.init_from, "Start from this DFlash checkpoint (published or ours)");
  cmd->add_option("--max-length", c.max_length, "Truncate samples to this many tokens (raw data)")->capture_default_str();
  cmd->add_option("--seed", c.seed, "Seed of the initial weights, data order and anchors")->capture_default_str();
  cmd->add_flag("--shuffle,!--no-shuffle", c.shuffle, "A fresh order of the samples every epoch");
  cmd->add_option("--num-draft-layers", c.num_draft_layers, "Draft decoder layers")->capture_default_str();
  cmd->add_option("--num-taps", c.num_taps, "Target layers tapped (default formula of dflash.md)")->capture_default_str();
  cmd->add_option("--target-layer-ids", c.target_layer_ids, "Explicit tapped target layers")->delimiter(',');
  cmd->add_option("--drafter-type", c.drafter_type,
                  "Drafter: dflash, or dspark (every slot drafts; Markov and confidence heads; its own loss). "
                  "Default: --init-from's, else dflash")
      ->check(CLI::IsMember({"dflash", "dspark"}));
  cmd->add_option("--markov-rank", c.markov_rank, "DSpark: rank of the Markov head")->capture_default_str();
  cmd->add_option("--block-size", c.block_size, "Block size (0: DFlash 16, DSpark 7)")->capture_default_str();
  cmd->add_option("--mask-token-id", mask_id, "Mask token id (default: <|MASK|>, a spare row or an unused special token)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--layer-types", layer_types,
                  "Draft layer types, e.g. \"sliding_attention x4,full_attention\" (sets the layer count; default: "
                  "full_attention for every layer)");
  cmd->add_option("--sliding-window", c.sliding_window, "Window of the sliding layers (tokens, self included)");
  cmd->add_option("--num-attention-heads", heads, "Draft attention heads (default: the target's; Qwen3.5 / 3.6: 32)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--num-key-value-heads", kv_heads, "Draft key / value heads (default: the target's; Qwen3.5 / 3.6: 8)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--head-dim", head_dim, "Draft head dim (default: the target's; Qwen3.5 / 3.6: 128)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--intermediate-size", intermediate, "Draft MLP width (default: the target's)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--rope-scaling", rope_scaling,
                  "The drafter's rope_scaling as transformers reads it, JSON, e.g. "
                  "'{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":65536}'");
  cmd->add_option("--epochs", c.epochs, "Epochs over the data")->capture_default_str();
  cmd->add_option("--max-steps", c.max_steps, "Optimizer steps (0: by --epochs; more overrides --epochs)")->capture_default_str();
  cmd->add_option("--grad-accum", c.grad_accum, "Sequences per optimizer step")->capture_default_str();
  cmd->add_option("--num-anchors", c.num_anchors, "Anchors (blocks) per sequence")->capture_default_str();
  cmd->add_flag("--recompute", c.recompute, "GPU: recompute drafter layers in the backward (less memory, ~1 more forward)");
  cmd->add_option("--lr", c.lr, "Peak learning rate")->capture_default_str();
  cmd->add_option("--warmup-ratio", c.warmup_ratio, "Fraction of the steps spent warming up")->capture_default_str();
  cmd->add_option("--weight-decay", c.weight_decay, "AdamW weight decay")->capture_default_str();
  cmd->add_option("--beta1", c.beta1, "AdamW beta1")->capture_default_str();
  cmd->add_option("--beta2", c.beta2, "AdamW beta2")->capture_default_str();
  cmd->add_option("--eps", c.eps, "AdamW epsilon")->capture_default_str();
  cmd->add_option("--max-grad-norm", c.max_grad_norm, "Global gradient-norm clip")->capture_default_str();
  cmd->add_option("--gamma", c.gamma, "Loss decay over block slots (0: by block size; DSpark 4)")->capture_default_str();
  cmd->add_option("--loss", c.loss,
                  "Slot weights of the loss: dflash (the gamma decay) or dpace (D-PACE: from each slot's chance of "
                  "being accepted, detached)")
      ->check(CLI::IsMember({"dflash", "dpace"}))->capture_default_str();
  cmd->add_option("--eval-data", c.eval_data,
                  "Held-out prompt files: real speculative decoding with the drafter during training (tau_real)");
  cmd->add_option("--eval-every", c.eval_every, "Evaluate every N steps (0: only at the end)")->capture_default_str();
  cmd->add_option("--eval-limit", c.eval_limit, "Conversations of each --eval-data file")->capture_default_str();
  cmd->add_option("--eval-max-new-tokens", c.eval_max_new_tokens, "Tokens generated per answer in the evaluation")
      ->capture_default_str();
  cmd->add_option("--eval-batch-size", c.eval_batch_size, "Conversations decoded together in the evaluation")
      ->capture_default_str();
  cmd->add_option("--save-every", c.save_every, "Checkpoint every N steps")->capture_default_str();
  cmd->add_option("--keep-last", c.keep_last, "Checkpoints kept")->capture_default_str();
  cmd->add_option("--log-every", c.log_every, "Progress line every N steps")->capture_default_str();
  cmd->add_option("--stages-every", c.stages_every, "Stage breakdown every N steps")->capture_default_str();
  cmd->add_option("--nan-abort", c.nan_abort, "Stop after this many non-finite steps in a row")->capture_default_str();
  cmd->add_option("--steps-this-run", c.steps_this_run, "Checkpoint and exit after N steps (time-sliced jobs; 0: run to the end)")->capture_default_str();
  cmd->add_flag("--resume", c.resume, "Continue the run in --out from its last checkpoint");
  cmd->callback([&run, cmd] {
    run = [cmd] {
      TrainConfig cfg;
      if (!config_file.empty()) cfg = train_config_from_json(read_json_file(config_file), config_file);
      // Flags given on the command line win over the file.
      const nlohmann::json flags = to_json(c);
      nlohmann::json merged = to_json(cfg);
      for (auto* opt : cmd->get_options()) {
        if (opt->count() == 0) continue;
        if (opt->get_lnames().empty()) continue;
        std::string key = opt->get_lnames().front();  // --shuffle,!--no-shuffle -> "shuffle"
        std::replace(key.begin(), key.end(), '-', '_');
        if (flags.contains(key)) merged[key] = flags[key];
      }
      if (mask_id >= 0) merged["mask_token_id"] = mask_id;
      if (!layer_types.empty()) {
        merged["layer_types"] = parse_layer_types(layer_types);
        if (cmd->get_option("--num-draft-layers")->count() == 0) merged["num_draft_layers"] = merged["layer_types"].size();
      }
      for (const auto& [v, key] : {std::pair{heads, "num_attention_heads"}, {kv_heads, "num_key_value_heads"},
                                   {head_dim, "head_dim"}, {intermediate, "intermediate_size"}})
        if (v > 0) merged[key] = v;
      if (!rope_scaling.empty()) {
        try {
          merged["rope_scaling"] = nlohmann::json::parse(rope_scaling);
        } catch (const nlohmann::json::exception& e) {
          throw std::invalid_argument("--rope-scaling: not JSON (" + std::string(e.what()) + ")");
        }
      }
      cfg = train_config_from_json(merged, "command line");
      if (dump) {
        cfg.validate_values();
        fmt::print("{}\n", to_json(cfg).dump(2));
        return 0;
      }
      for (int sig : {SIGINT, SIGTERM}) std::signal(sig, on_signal);
      return run_training(cfg, g_stop);
    };
  });
}

}  // namespace dflash::cli
