// `dflash bench`: target-forward (CPU: a checkpoint; GPU: random weights of a preset), gdn,
// drafter-step, pipeline, tokenize; results appended to bench/results/<bench>.jsonl (src/bench/record.h).
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>

#include "bench/presets.h"
#include "bench/record.h"
#include "cli/commands.h"
#include "cli/spec_options.h"
#include "models/target_dtype.h"
#include "models/target.h"
#include "bench/cuda/decode_bench.h"
#include "bench/cuda/drafter_step_bench.h"
#include "bench/cuda/forward_bench.h"
#include "bench/cuda/pipeline_bench.h"

namespace dflash::cli {

namespace {

void add_bench_gdn(CLI::App& bench, Runner& run) {
  auto* cmd = bench.add_subcommand("gdn", "Time the GatedDeltaNet kernels on GPU 0 (Hk 16, Hv 48, d 128: T 4096, "
                                          "T 16384, 8 x 512 packed)");
  static std::string results = "bench/results";
  static int steps = 20, warmup = 5;
  static bool no_record = false;
  cmd->add_option("--steps", steps, "Timed runs (the median is recorded)")->capture_default_str()->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", warmup, "Untimed runs first")->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_option("--results", results, "Directory of the JSONL records")->capture_default_str();
  cmd->add_flag("--no-record", no_record, "Print only; append nothing to the results");
  cmd->callback([&run] {
    run = [] {
      return run_gdn_bench({steps, warmup, results, !no_record});
    };
  });
}

void add_bench_decode(CLI::App& bench, Runner& run) {
  auto* cmd = bench.add_subcommand("decode",
                                   "Time batch decoding on GPU 0 (random weights, real shapes) beside the memory-bandwidth "
                                   "bound");
  static std::string preset, results = "bench/results";
  static std::vector<int64_t> batches = {1, 16, 64, 256};
  static int64_t prompt_tokens = 128, new_tokens = 512;
  static bool no_record = false;
  static TargetDtype dtype = TargetDtype::kBf16;
  cmd->add_option("--preset", preset, "qwen3.6-27b | qwen3-8b | qwen3.6-35b-a3b | tiny")->required();
  cmd->add_option("--batch", batches, "Batch sizes (sequences decoded together)")
      ->delimiter(',')->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(4096)));
  cmd->add_option("--prompt-tokens", prompt_tokens, "Prompt length of every sequence")
      ->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(1) << 16));
  cmd->add_option("--new-tokens", new_tokens, "Tokens decoded per sequence")
      ->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(1) << 16));
  cmd->add_option("--results", results, "Directory of the JSONL records")->capture_default_str();
  cmd->add_flag("--no-record", no_record, "Print only; append nothing to the results");
  add_target_dtype_option(cmd, dtype);
  cmd->callback([&run] {
    run = [] {
      pipeline_bench_preset(preset);  // an unknown preset is refused in every build
      return run_decode_bench({preset, batches, prompt_tokens, new_tokens, dtype, results, !no_record});
    };
  });
}

void add_bench_drafter_step(CLI::App& bench, Runner& run) {
  auto* cmd = bench.add_subcommand("drafter-step",
                                   "Time one drafter training step on GPU 0 (random weights, published shapes)");
  static std::string preset, results = "bench/results";
  static int64_t seq = 0, anchors = 512;
  static int steps = 10, warmup = 3;
  static bool no_record = false, recompute = false, dpace = false;
  cmd->add_option("--preset", preset, "qwen3-8b | qwen3.6-27b | qwen3.6-35b-a3b | tiny")->required();
  cmd->add_option("--seq", seq, "Context length S (default: the preset's, 3072 / 4096)");
  cmd->add_option("--anchors", anchors, "Anchors per sequence")->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(1) << 16));
  cmd->add_option("--steps", steps, "Timed steps (the median is recorded)")->capture_default_str()->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", warmup, "Untimed steps first")->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_option("--results", results, "Directory of the JSONL records")->capture_default_str();
  cmd->add_flag("--no-record", no_record, "Print only; append nothing to the results");
  cmd->add_flag("--recompute", recompute, "Activation recomputation per drafter layer");
  cmd->add_flag("--dpace", dpace, "D-PACE's slot weights (dflash train --loss dpace)");
  cmd->callback([&run] {
    run = [] {
      return run_drafter_step_bench({preset, seq, anchors, steps, warmup, results, !no_record, recompute, dpace});
    };
  });
}

void add_bench_pipeline(CLI::App& bench, Runner& run) {
  auto* cmd = bench.add_subcommand("pipeline",
                                   "Time one sample of the training pipeline on GPU 0: target taps + drafter step "
                                   "(random weights, real shapes)");
  static std::string preset, results = "bench/results";
  static int64_t seq = 0, anchors = 512;
  static int steps = 10, warmup = 3;
  static bool no_record = false;
  cmd->add_option("--preset", preset, "qwen3-8b | qwen3.6-27b | qwen3.6-35b-a3b | tiny")
      ->required();
  cmd->add_option("--seq", seq, "Context length S (default: the preset's, 3072 for qwen3-8b)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 20));
  cmd->add_option("--anchors", anchors, "Anchors per sequence")->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(1) << 16));
  cmd->add_option("--steps", steps, "Timed samples (the median is recorded)")->capture_default_str()->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", warmup, "Untimed samples first")->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_option("--results", results, "Directory of the JSONL records")->capture_default_str();
  cmd->add_flag("--no-record", no_record, "Print only; append nothing to the results");
  static std::vector<int> gpus, target_gpus, drafter_gpus;
  static int per_replica = 2;
  cmd->add_option("--gpus", gpus, "Run the dflash train path colocated on these GPUs (e.g. 0 or 0,1)")->delimiter(',');
  cmd->add_option("--target-gpus", target_gpus, "The train path with the target replicas here (with --drafter-gpus)")
      ->delimiter(',');
  cmd->add_option("--drafter-gpus", drafter_gpus, "The train path with the drafter replicas here")->delimiter(',');
  cmd->add_option("--per-replica", per_replica, "Train path: samples per drafter replica per optimizer step")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  static TargetDtype dtype = TargetDtype::kBf16;
  add_target_dtype_option(cmd, dtype);
  cmd->callback([&run] {
    run = [] {
      // Unknown presets and targets the GPU cannot run are refused with the reason in every build.
      pipeline_bench_preset(preset);
      if (!gpus.empty() && (!target_gpus.empty() || !drafter_gpus.empty()))
        throw std::invalid_argument("bench pipeline: --gpus or --target-gpus / --drafter-gpus, not both");
      PipelineBenchOptions po{preset, seq, anchors, steps, warmup, results, !no_record, {}, {}, per_replica};
      po.target_gpus = target_gpus;
      po.target_dtype = dtype;
      po.drafter_gpus = gpus.empty() ? drafter_gpus : gpus;
      return run_pipeline_bench(po);
    };
  });
}

}  // namespace

void add_bench(CLI::App& app, Runner& run) {
  auto* bench = app.add_subcommand("bench", "Benchmarks; results are appended to bench/results/");
  bench->require_subcommand(1);
  auto* tf = bench->add_subcommand("target-forward", "Time a target's forward pass (random token ids)");
  add_bench_tokenize(*bench, run);
  add_bench_drafter_step(*bench, run);
  add_bench_pipeline(*bench, run);
  add_bench_gdn(*bench, run);
  add_bench_decode(*bench, run);
  static std::string model, preset, results = "bench/results", device = "cpu";
  static int64_t tokens = 0, layers = 0;
  static int repeat = 3;
  static bool no_record = false;
  tf->add_option("--model", model, "Checkpoint directory or .gguf file (CPU); with --device cuda, random weights of --preset");
  tf->add_option("--tokens", tokens, "Sequence length T (default 256 on the CPU, 4096 with --device cuda)")->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  tf->add_option("--repeat", repeat, "Timed runs (the median is recorded)")->capture_default_str()->check(CLI::Range(1, 1000));
  tf->add_option("--preset", preset,
                 "Preset name in the record (default: the model's file name and the device, e.g. qwen3_5-cpu); "
                 "with --device cuda: qwen3.6-27b | qwen3.6-35b-a3b | qwen3-8b | tiny");
  tf->add_option("--layers", layers, "--device cuda: only the preset's first N layers")->check(CLI::Range(int64_t(1), int64_t(1024)));
  tf->add_option("--device", device, "Device")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  tf->add_option("--results", results, "Directory of the JSONL records")->capture_default_str();
  tf->add_flag("--no-record", no_record, "Print only; append nothing to the results");
  static TargetDtype tf_dtype = TargetDtype::kBf16;
  add_target_dtype_option(tf, tf_dtype);
  tf->callback([&run] {
    run = [] {
      if (device == "cuda") {
        if (preset.empty() || !model.empty())
          throw std::invalid_argument("bench target-forward --device cuda: give --preset (random weights), not --model");
        return run_target_forward_gpu_bench(
            {preset, tokens ? tokens : 4096, layers, repeat, 2, results, !no_record, tf_dtype});
      }
      if (model.empty()) throw std::invalid_argument("bench target-forward: --model is required on the CPU");
      if (!tokens) tokens = 256;
      auto target = TargetModel::load(model);
      std::mt19937 rng(1234);
      std::uniform_int_distribution<int32_t> tok(0, int32_t(target->spec().vocab_size - 1));
      std::vector<int32_t> ids(static_cast<size_t>(tokens));
      for (auto& t : ids) t = tok(rng);
      std::vector<double> secs;
      for (int r = 0; r <= repeat; ++r) {  // run 0 is the warm-up
        const auto t0 = std::chrono::steady_clock::now();
        target->forward(ids, {0, tokens}, ForwardOptions{});
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) secs.push_back(s);
      }
      std::sort(secs.begin(), secs.end());
      const double med = secs[secs.size() / 2];
      BenchRecord rec;
      rec.bench = "target-forward";
      rec.preset = preset.empty() ? std::filesystem::path(model).stem().string() + "-" + device : preset;
      rec.metric = "tokens_per_s";
      rec.value = double(tokens) / med;
      rec.unit = "tokens/s";
      rec.extra = {{"tokens", tokens}, {"repeat", repeat}, {"median_s", med}, {"min_s", secs.front()},
                   {"max_s", secs.back()}, {"device_kind", device}, {"path", "CPU reference (fp32, OpenBLAS)"}};
      print_bench_record(results, rec, !no_record);
      return 0;
    };
  });
}

}  // namespace dflash::cli
