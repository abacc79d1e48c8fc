#include "train/run.h"

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>

#include "gpu/backend.h"
#include "gpu/device_info.h"
#include "io/json_file.h"
#include "io/temp_files.h"
#include "models/drafter_checkpoint.h"
#include "models/drafter_config.h"
#include "models/target.h"
#include "models/target_dtype.h"
#include "text/packed.h"
#include "text/prepare.h"
#include "text/tokenizer.h"
#include "train/anchors.h"
#include "train/distributed.h"
#include "train/gpu.h"
#include "train/gpu_power.h"
#include "train/prepare_data.h"
#include "train/tensorboard.h"
#include "train/train_eval.h"
#include "train/trainer.h"

namespace dflash {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double secs_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string duration_str(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = int64_t(s);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, int(t % 3600 / 60)) : fmt::format("{}m{:02d}s", t / 60, int(t % 60));
}

/// OUT/checkpoints/step-NNNNNNNN directories, oldest first.
std::vector<fs::path> checkpoints(const fs::path& dir) {
  std::vector<fs::path> r;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.size() == 13 && n.rfind("step-", 0) == 0 && n.find_first_not_of("0123456789", 5) == std::string::npos)
      r.push_back(e.path());
  }
  std::sort(r.begin(), r.end());
  return r;
}

/// Expected acceptance length from per-slot top-1 accuracies, slots independent:
/// tau = 1 + sum_k prod_{j <= k} acc_j over the drafting slots k = first .. B-1 (DFlash 1, DSpark 0).
double tau_estimate(const std::vector<int64_t>& correct, const std::vector<int64_t>& count, size_t first) {
  double tau = 1, run = 1;
  for (size_t k = first; k < correct.size(); ++k) {
    if (count[k] == 0) break;
    run *= double(correct[k]) / double(count[k]);
    tau += run;
  }
  return tau;
}

std::string memory_str(const std::string& device) {
  if (device == "cuda")
    if (const int64_t used = cuda::memory_in_use(); used >= 0) return fmt::format("{:.1f} GB", double(used) / 1e9);
  return "-";
}

/// The GPUs this process trains on (target and drafter devices, once each) as (index, PCI bus id), for
/// PowerSampler; empty on the CPU.
std::vector<std::pair<int, std::string>> process_gpus(const TrainConfig& c) {
  std::vector<std::pair<int, std::string>> r;
  if (c.device != "cuda") return r;
  std::vector<int> ids = c.target_devices();
  ids.insert(ids.end(), c.drafter_devices().begin(), c.drafter_devices().end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const auto all = cuda::devices();
  for (int i : ids)
    for (const cuda::DeviceInfo& d : all)
      if (d.index == i) r.emplace_back(i, d.pci_bus_id);
  return r;
}

/// "gpu power over the last N steps: cuda:0 690 of 700 W, SM clock ...; cuda:1 ...": what holds the
/// clocks down (an H200 under bf16 GEMMs sits at its power cap). The GPUs of this process only.
std::string power_report(const std::vector<std::pair<int, std::string>>& gpus, const std::vector<PowerSummary>& p,
                         int64_t steps) {
  std::string r = fmt::format("gpu power over the last {} steps:", steps);
  for (size_t i = 0; i < gpus.size() && i < p.size(); ++i)
    r += fmt::format("{} cuda:{} {}", i ? ";" : "", gpus[i].first, p[i].words());
  return r;
}

struct StageWindow {
  double target_ms = 0, drafter_ms = 0, queue_ms = 0, optimizer_ms = 0, wall_s = 0;  // per replica
  double eval_ms = 0;  // real speculative decoding of the held-out prompts (--eval-data)
  int64_t steps = 0;
  bool overlap = false;  // target and drafter on separate GPUs, running at the same time
};

/// The stage breakdown line (per replica, % of wall time) and the bottleneck in words. Colocated,
/// the stages follow each other; disaggregated (overlap), the target side runs beside the drafter's.
std::string stage_report(const StageWindow& w, const std::string& device) {
  const double wall = std::max(w.wall_s * 1e3, 1e-9);
  const double t = w.target_ms / wall, d = w.drafter_ms / wall, q = w.queue_ms / wall, o = w.optimizer_ms / wall;
  const double e = w.eval_ms / wall;
  const double other = std::max(0.0, 1.0 - (w.overlap ? std::max(t, d + q) : t + d + q) - o - e);
  std::string verdict;
  if (q >= 0.15)
    verdict = fmt::format("drafter GPUs wait {:.0f}% on the target: add target GPUs (--target-gpus), or shorten "
                          "--max-length", 100 * q);
  else if (t >= d && t >= other)
    verdict = "the target forward is the bottleneck: the drafter waits " + fmt::format("{:.0f}%", 100 * t) +
              " of the time on it (" + (device == "cpu" ? "use --device cuda" : "give the target more GPUs") +
              ", or shorten --max-length)";
  else if (d >= other)
    verdict = "the drafter step is the bottleneck (" + fmt::format("{:.0f}%", 100 * d) +
              "): lower --num-anchors or add drafter GPUs";
  else
    verdict = fmt::format("{:.0f}% of the time is outside the compute stages (data loading, logging, checkpoints)",
                          100 * other);
  return fmt::format("stages over the last {} steps ({}): target forward {:.0f}% | queue wait {:.0f}% | drafter "
                     "forward+backward {:.0f}% | optimizer + all-reduce {:.0f}% | {}other {:.0f}% -> {}",
                     w.steps, device, 100 * t, 100 * q, 100 * d, 100 * o,
                     w.eval_ms > 0 ? fmt::format("eval {:.0f}% | ", 100 * e) : std::string(), 100 * other, verdict);
}

std::unique_ptr<Tokenizer> load_tokenizer(const TrainConfig& c) {
  const std::string path = c.tokenizer.empty() ? c.target : c.tokenizer;
  const bool present = fs::is_regular_file(path) || fs::exists(fs::path(path) / "tokenizer.json");
  if (!present) {
    if (!c.tokenizer.empty()) throw std::runtime_error("--tokenizer " + path + ": no tokenizer.json there");
    return nullptr;
  }
  return Tokenizer::load(path);
}

}  // namespace

int run_training(const TrainConfig& cin, const std::atomic<int>& stop) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines reach a redirected log as they happen
  TrainConfig c = cin;
  c.validate();
  // Several processes (mpirun / srun): each drives its node's GPUs, rank 0 writes everything.
  const ProcessGroup pg = process_group_from_env();
  const bool leader = pg.rank == 0;
  if (pg.world > 1) {
    if (c.device != "cuda") throw std::runtime_error("several processes (" + pg.launcher + ") need --device cuda");
    if (c.data.size() != 1 || !is_packed_dir(c.data[0]))
      throw std::runtime_error("several processes read a prepared --data directory: run dflash prepare first");
    // The GPU lists are per process; the processes of a node take consecutive blocks of GPUs.
    int span = 0;
    for (const auto* l : {&c.gpus, &c.target_gpus, &c.drafter_gpus})
      for (int g : *l) span = std::max(span, g + 1);
    for (auto* l : {&c.gpus, &c.target_gpus, &c.drafter_gpus})
      for (int& g : *l) g += pg.local_rank * span;
    fmt::print("train: process {} of {} ({}), GPUs {}\n", pg.rank, pg.world, pg.launcher,
               nlohmann::json(c.drafter_devices()).dump());
  }
  if (c.device == "cuda") {
    if (!cuda_backend_built()) throw std::runtime_error(no_cuda_backend("--device cuda"));
    for (const auto* l : {&c.target_devices(), &c.drafter_devices()})
      for (int g : *l) cuda::require_device("train --device cuda", g);
  }
  if (!c.target_layer_ids.empty()) c.num_taps = int64_t(c.target_layer_ids.size());
  const fs::path out(c.out), ckdir = out / "checkpoints";
  fs::create_directories(out);
  std::optional<DirLock> lock;  // rank 0 owns the output directory
  if (leader) {
    lock.emplace(out, "dflash train");
    remove_stale_temp(out, ".partial-", "train");
    remove_stale_temp(out, ".tmp-", "train");
    remove_stale_temp(ckdir, ".tmp-", "train");
    remove_stale_temp(ckdir, ".old-", "train");
  }
  const std::vector<fs::path> existing = checkpoints(ckdir);
  if (!c.resume && (!existing.empty() || fs::exists(out / "final")))
    throw std::runtime_error(c.out + " already holds a run's checkpoints: pass --resume to continue it, or choose "
                             "another --out");
  if (c.resume && fs::exists(out / "final")) {
    fmt::print("train: the run in {} has finished; its drafter is in {}\n", c.out, (out / "final").string());
    return 0;
  }
  if (c.resume && existing.empty())
    throw std::runtime_error("--resume: no checkpoint in " + ckdir.string() + " to continue from");
  if (c.resume && fs::exists(out / "train_config.json")) {  // the taps come from the target as that run ran it
    const nlohmann::json was = read_json_file((out / "train_config.json").string());
    const std::string dt = was.value("target_dtype", std::string("bf16"));
    if (dt != c.target_dtype)
      throw std::runtime_error("--resume: the run in " + c.out + " was trained with --target-dtype " + dt +
                               ", not " + c.target_dtype + ": pass --target-dtype " + dt + " (or start a new --out)");
  }

  // Tokenizer and data first (quick to check), then the target.
  const ModelSpec spec = open_model(c.target).spec;
  const auto tok = load_tokenizer(c);
  std::string data_dir;
  try {
    data_dir = prepared_data_dir(c, tok.get(), out / "data", stop);
  } catch (const std::exception&) {
    if (const int sig = stop.load()) {
      fmt::print("train: interrupted (signal {}) while preparing the data; nothing was written\n", sig);
      return 128 + sig;
    }
    throw;
  }
  const PackedDataset ds(data_dir);
  const int64_t n = ds.num_samples();
  bool any_anchor = false;
  int32_t max_id = 0;
  int64_t longest = 0, longest_at = 0;
  for (int64_t i = 0; i < n; ++i) {
    any_anchor = any_anchor || !anchor_candidates(ds.loss_mask(i)).empty();
    for (int32_t t : ds.ids(i)) max_id = std::max(max_id, t);
    if (int64_t(ds.ids(i).size()) > longest) longest = int64_t(ds.ids(i).size()), longest_at = i;
  }
  if (!any_anchor)
    throw std::runtime_error(data_dir + ": no sample has two consecutive assistant tokens: nothing to train on");
  if (max_id >= spec.vocab_size)
    throw std::runtime_error(fmt::format("{}: token id {} is outside the target's vocabulary of {}: the data was "
                                         "tokenized with another tokenizer than the target's",
                                         data_dir, max_id, spec.vocab_size));
  if (spec.max_position_embeddings > 0 && longest > spec.max_position_embeddings)
    throw std::runtime_error(fmt::format("{}: sample {} has {} tokens, more than the target's max_position_embeddings "
                                         "{}: prepare the data again with --max-length {} or less",
                                         data_dir, longest_at, longest, spec.max_position_embeddings,
                                         spec.max_position_embeddings));
  if (c.grad_accum > n)
    throw std::runtime_error(fmt::format("--grad-accum {} is larger than the {} samples of the data", c.grad_accum, n));
  fmt::print("train: loading the target {}\n", c.target);
  const auto target = TargetModel::load(c.target);

  // Drafter.
  DrafterConfig dc;
  DrafterWeights<float> w0;
  if (!c.init_from.empty()) {
    // The checkpoint's drafter, whatever its layout, if it fits this target; the layout flags this
    // run sets must agree with it.
    w0 = load_drafter_weights<float>(c.init_from, &dc);
    if (dc.mask_token_id < 0 && tok) resolve_mask_token_id(dc, *tok, c.init_from);
    check_drafter_fits(dc, target->spec(), "--init-from " + c.init_from);
    std::string diff;
    auto differs = [&](bool set, const std::string& what, const nlohmann::json& theirs, const nlohmann::json& ours) {
      if (set && theirs != ours) diff += (diff.empty() ? "" : ", ") + what + " " + theirs.dump() + " (this run: " + ours.dump() + ")";
    };
    differs(!c.layer_types.empty(), "layer_types", dc.layer_types, c.layer_types);
    differs(c.sliding_window > 0, "sliding_window", dc.sliding_window, c.sliding_window);
    differs(bool(c.num_attention_heads), "num_attention_heads", dc.num_attention_heads, c.num_attention_heads.value_or(0));
    differs(bool(c.num_key_value_heads), "num_key_value_heads", dc.num_key_value_heads, c.num_key_value_heads.value_or(0));
    differs(bool(c.head_dim), "head_dim", dc.head_dim, c.head_dim.value_or(0));
    differs(bool(c.intermediate_size), "intermediate_size", dc.intermediate_size, c.intermediate_size.value_or(0));
    differs(!c.target_layer_ids.empty(), "target_layer_ids", dc.target_layer_ids, c.target_layer_ids);
    differs(bool(c.mask_token_id), "mask_token_id", dc.mask_token_id, c.mask_token_id.value_or(-1));
    differs(c.block_size > 0, "block_size", dc.block_size, c.block_size);
    differs(!c.drafter_type.empty(), "drafter_type", dc.is_dspark() ? "dspark" : "dflash", c.drafter_type);
    differs(c.num_draft_layers != TrainConfig{}.num_draft_layers && c.layer_types.empty(), "num_hidden_layers",
            dc.num_hidden_layers, c.num_draft_layers);
    if (!diff.empty())
      throw std::runtime_error("--init-from " + c.init_from + ": its drafter differs from what this run's flags ask: " +
                               diff + "; leave those flags out to train the checkpoint's drafter as it is");
    fmt::print("train: --init-from {}: its drafter as it is: {} layers ({}), heads {} / {} x {}, taps {}, block {}, "
               "mask token {}\n", c.init_from, dc.num_hidden_layers, nlohmann::json(dc.layer_types).dump(),
               dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim, nlohmann::json(dc.target_layer_ids).dump(),
               dc.block_size, dc.mask_token_id);
  } else {
    DrafterOverrides ov;
    ov.num_hidden_layers = c.num_draft_layers;
    if (c.block_size > 0) ov.block_size = c.block_size;
    if (c.drafter_type == "dspark") ov.markov_rank = c.markov_rank;
    ov.num_taps = c.num_taps;
    if (c.mask_token_id) ov.mask_token_id = *c.mask_token_id;
    if (!c.target_layer_ids.empty()) ov.target_layer_ids = c.target_layer_ids;
    ov.layer_types = c.layer_types;
    if (c.sliding_window > 0) ov.sliding_window = c.sliding_window;
    ov.num_attention_heads = c.num_attention_heads, ov.num_key_value_heads = c.num_key_value_heads;
    ov.head_dim = c.head_dim, ov.intermediate_size = c.intermediate_size;
    ov.rope_scaling = c.rope_scaling;
    if (!tok && !c.mask_token_id)
      throw std::runtime_error(c.target + ": no tokenizer to choose the mask token from; pass --tokenizer or --mask-token-id");
    dc = derive_drafter_config(target->spec(), tok.get(), ov);
    w0 = init_drafter_weights(dc, c.seed);
  }

  TrainerOptions to;
  to.num_anchors = c.num_anchors;
  to.grad_accum = c.grad_accum;
  to.max_grad_norm = c.max_grad_norm;
  to.gamma = c.gamma > 0 ? c.gamma : dc.is_dspark() ? 4.0 : default_gamma(dc.block_size);  // DSpark: DeepSpec's 4
  to.dpace = c.loss == "dpace";
  if (dc.is_dspark() && to.dpace) throw std::runtime_error("--loss dpace weighs a DFlash drafter's slots; DSpark has its own loss");
  to.seed = c.seed;
  to.shuffle = c.shuffle;
  to.adamw = {c.lr, c.beta1, c.beta2, c.eps, c.weight_decay};
  const int64_t per_epoch = (n + c.grad_accum - 1) / c.grad_accum;
  const int64_t total = c.max_steps > 0 ? c.max_steps : c.epochs * per_epoch;
  to.schedule = {c.lr, total, c.warmup_ratio};

  if (c.device == "cuda") {
    int64_t longest = 0, shortest = INT64_MAX;
    for (int64_t i = 0; i < n; ++i) {
      longest = std::max<int64_t>(longest, int64_t(ds.ids(i).size()));
      shortest = std::min<int64_t>(shortest, int64_t(ds.ids(i).size()));
    }
    check_gpu_memory(c, dc, target->spec(), longest, shortest, pg.world);
  }

  std::unique_ptr<DrafterBackend> backend;
  if (c.device == "cpu") {
    backend = make_cpu_backend(dc, std::move(w0), &target->embed_tokens(), &target->lm_head(), [&](const TrainSample& s) {
      ForwardOptions fo;
      fo.logits = false;
      fo.hidden_states = tap_hidden_states(captured_layer_ids(dc));
      const auto S = int64_t(s.ids.size());
      return concat_taps(target->forward(std::vector<int32_t>(s.ids.begin(), s.ids.end()), {0, S}, fo),
                         captured_layer_ids(dc));
    });
  } else {
    backend = make_gpu_backend(dc, w0, *target, c.target_devices(), c.drafter_devices(),
                               GpuTrainOptions{c.recompute, c.target_batch_tokens, parse_target_dtype(c.target_dtype), pg});
  }
  DrafterTrainer tr(dc, std::move(backend), n, to);
  std::optional<TrainEval> eval;  // --eval-data: real acceptance of held-out prompts (rank 0)
  if (!c.eval_data.empty() && leader) {
    if (!tok) throw std::runtime_error("--eval-data: the target has no tokenizer to encode the prompts with; pass --tokenizer");
    const std::string tok_path = c.tokenizer.empty() ? c.target : c.tokenizer;
    eval.emplace(*target, *tok, chat_family_for(*tok, c.chat_template, tok_path), c.eval_data, c.eval_limit,
                 c.eval_max_new_tokens, int(c.eval_batch_size), c.device, c.drafter_devices().at(0),
                 parse_target_dtype(c.target_dtype));
    fmt::print("train: real acceptance of {} held-out conversations ({}) {}\n", eval->conversations(),
               fmt::format("{}", fmt::join(c.eval_data, ", ")),
               c.eval_every > 0 ? fmt::format("every {} steps and at the end", c.eval_every) : std::string("at the end"));
  }
  if (c.resume) {
    tr.resume(existing.back().string());
    fmt::print("train: resumed from {} at step {} (epoch {}, sample {} of the epoch)\n", existing.back().string(),
               tr.step_count(), tr.position().epoch, tr.position().index);
  }

  nlohmann::json resolved = to_json(c);
  resolved["drafter"] = drafter_config_to_json(dc);
  resolved["resolved"] = {{"total_steps", total},      {"steps_per_epoch", per_epoch}, {"num_samples", n},
                          {"data_dir", data_dir},      {"gamma", to.gamma},             {"warmup_steps", to.schedule.warmup_steps()},
                          {"device", tr.backend().device()}};
  if (leader) write_file_atomic((out / "train_config.json").string(), resolved.dump(2) + "\n");
  if (leader)
    fmt::print("train: {} samples, {} steps ({} per epoch), drafter {} layers x {} (taps {}), block {}, {} anchors, "
             "mask token {}, loss {}, lr {} (warmup {} steps), device {}\n",
             n, total, per_epoch, dc.num_hidden_layers, dc.hidden_size, nlohmann::json(dc.target_layer_ids).dump(),
             dc.block_size, c.num_anchors, dc.mask_token_id,
             dc.is_dspark() ? fmt::format("DSpark (0.1 CE + 0.9 L1 + confidence BCE, gamma {}, Markov rank {})", to.gamma, dc.markov_rank)
             : to.dpace     ? std::string("D-PACE")
                            : fmt::format("gamma {}", to.gamma),
             c.lr, to.schedule.warmup_steps(), tr.backend().device());

  auto save_checkpoint = [&] {
    const fs::path dir = ckdir / fmt::format("step-{:08d}", tr.step_count());
    if (!leader) return dir;  // rank 0 writes it
    fs::create_directories(ckdir);
    tr.save(dir.string());
    auto all = checkpoints(ckdir);
    while (int64_t(all.size()) > c.keep_last) {
      fs::remove_all(all.front());
      all.erase(all.begin());
    }
    return dir;
  };

  // metrics.jsonl: a fresh run starts it anew; a resumed run keeps the lines up to its step.
  std::vector<std::string> kept;
  if (c.resume) {
    std::ifstream old(out / "metrics.jsonl");
    for (std::string line; std::getline(old, line);) {
      try {
        const nlohmann::json m = nlohmann::json::parse(line);
        const auto step = m.find("step");
        if (step != m.end() && step->is_number_integer() && step->get<int64_t>() <= tr.step_count()) kept.push_back(line);
      } catch (const nlohmann::json::exception&) {  // a line cut by a hard kill
      }
    }
  }
  std::ofstream metrics;
  std::optional<TensorBoardWriter> tb;
  if (leader) {
    metrics.open(out / "metrics.jsonl", std::ios::trunc);
    for (const auto& line : kept) metrics << line << "\n";
    tb.emplace((out / "tensorboard").string());
  }
  if (const int sig = stop.load()) {
    fmt::print("train: interrupted (signal {}) before the first step; nothing to save\n", sig);
    return 128 + sig;
  }
  const auto t_start = Clock::now();
  const int64_t step0 = tr.step_count();
  int64_t nan_run = 0, skipped_total = 0, last_saved = tr.step_count();
  int64_t win_micro = 0, win_tokens = 0;
  std::vector<int64_t> win_correct(size_t(dc.block_size), 0), win_count(size_t(dc.block_size), 0);
  double win_loss = 0;
  int64_t win_loss_n = 0;
  const bool disaggregated = !c.target_gpus.empty();
  StageWindow stages;
  stages.overlap = disaggregated;
  const auto gpus = leader ? process_gpus(c) : std::vector<std::pair<int, std::string>>{};
  std::vector<std::string> bus_ids;
  for (const auto& g : gpus) bus_ids.push_back(g.second);
  PowerSampler power(bus_ids);
  auto t_win = Clock::now(), t_stage = Clock::now();
  double tau_real = NAN;  // the last evaluation's
  int64_t tau_real_step = 0;
  // Decodes the held-out prompts with the drafter as it would be saved; reports tau_real.
  auto evaluate = [&](int64_t s) {
    if (!eval) return;
    const TrainEvalResult r = eval->run(dc, tr.backend().state().weights);
    tau_real = r.acceptance.tau, tau_real_step = s;
    stages.eval_ms += r.ms;
    t_win += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(r.ms));  // (not in tok/s)
    fmt::print("eval step {}: tau_real {:.3f} ({} turns, {} tokens, {} verify steps, {:.1f} s)\n", s, r.acceptance.tau,
               r.turns, r.generated_tokens, r.acceptance.steps, r.ms / 1e3);
    metrics << nlohmann::json{{"step", s}, {"tau_real", r.acceptance.tau}, {"eval_turns", r.turns},
                              {"eval_tokens", r.generated_tokens}, {"eval_ms", r.ms},
                              {"slot_accept_real", r.acceptance.slot_accept}}
                   .dump()
            << "\n";
    metrics.flush();
    if (tb) tb->scalars(s, {{"eval/tau_real", r.acceptance.tau}, {"perf/eval_s", r.ms / 1e3}});
  };
  while (tr.step_count() < total) {
    const TrainStepStats st = tr.step([&](int64_t i) {
      TrainSample s;
      const auto ids = ds.ids(i);
      const auto mask = ds.loss_mask(i);
      s.ids.assign(ids.begin(), ids.end());
      s.loss_mask.assign(mask.begin(), mask.end());
      return s;
    });
    if (leader)
      for (const auto& [example, ts] : st.tap_stats) fmt::print("train: taps of example {}: {}\n", example, tap_summary(ts));
    // A stop (signal) in any process stops all of them after this step.
    const int sig_here = stop.load();
    const int sig_any = tr.backend().any_rank(sig_here != 0) ? (sig_here ? sig_here : SIGTERM) : 0;
    // Replicas run their micro-batches at the same time: per replica, a stage took its sum / replicas.
    // (With several processes the step's results hold every process's micro-batches.)
    const double nt = c.device == "cuda" ? double(c.target_devices().size() * size_t(pg.world)) : 1.0,
                 nd = c.device == "cuda" ? double(c.drafter_devices().size() * size_t(pg.world)) : 1.0;
    stages.target_ms += st.target_ms / nt, stages.drafter_ms += st.drafter_ms / nd;
    stages.queue_ms += st.queue_ms / nd, stages.optimizer_ms += st.optimizer_ms;
    win_micro += st.micro_batches, win_tokens += st.tokens;
    if (st.skipped) {
      ++skipped_total;
      if (!std::isfinite(st.grad_norm)) {
        if (++nan_run >= c.nan_abort) {
          const auto cks = checkpoints(ckdir);
          throw std::runtime_error(fmt::format(
              "{} steps in a row had non-finite gradients (last: {}; loss {}): stopping. Lower --lr or check the data; {}",
              nan_run, st.nonfinite, st.loss,
              cks.empty() ? std::string("no checkpoint was written yet")
                          : "the last good checkpoint is " + cks.back().string()));
        }
        if (leader)
          fmt::print(stderr, "train: step {} skipped: {} ({} in a row)\n", tr.step_count() + 1, st.nonfinite, nan_run);
      }
      if (sig_any == 0) continue;
    } else {
      nan_run = 0;
      win_loss += st.loss, ++win_loss_n;
      for (size_t k = 0; k < win_correct.size(); ++k) win_correct[k] += st.slot_correct[k], win_count[k] += st.slot_count[k];
    }
    const int64_t s = tr.step_count();
    if (!st.skipped && (s % c.log_every == 0 || s == total)) {
      const double dt = secs_since(t_win), elapsed = secs_since(t_start);
      int64_t hit = 0, cnt = 0;
      const size_t first_slot = dc.is_dspark() ? 0 : 1;  // DFlash's slot 0 is the anchor
      for (size_t k = first_slot; k < win_correct.size(); ++k) hit += win_correct[k], cnt += win_count[k];
      const double acc = cnt ? double(hit) / double(cnt) : 0.0;
      const double tau = tau_estimate(win_correct, win_count, first_slot);
      const double loss = win_loss_n ? win_loss / double(win_loss_n) : 0.0;
      const double eta = (s > step0) ? elapsed / double(s - step0) * double(total - s) : NAN;
      const double epoch = double(tr.position().epoch) + double(tr.position().index) / double(n);
      if (leader)
        fmt::print("step {}/{} | epoch {:.2f} | loss {:.4f} | acc {:.3f} | tau~{:.2f}{} | lr {:.2e} | {:.0f} tok/s | "
                 "{:.2f} samples/s | ETA {} | mem {}\n",
                 s, total, epoch, loss, acc, tau,
                 std::isnan(tau_real) ? std::string() : fmt::format(" (real {:.2f} @ {})", tau_real, tau_real_step), st.lr,
                 double(win_tokens) / dt, double(win_micro) / dt, duration_str(eta), memory_str(c.device));
      std::vector<double> slot_acc;
      for (size_t k = 0; k < win_correct.size(); ++k)
        slot_acc.push_back(win_count[k] ? double(win_correct[k]) / double(win_count[k]) : 0.0);
      metrics << nlohmann::json{{"step", s},           {"epoch", epoch},       {"loss", loss},
                                {"acc", acc},          {"slot_acc", slot_acc}, {"tau_estimate", tau},
                                {"lr", st.lr},         {"grad_norm", st.grad_norm},
                                {"tokens_per_s", double(win_tokens) / dt}, {"samples_per_s", double(win_micro) / dt},
                                {"skipped_steps", skipped_total}, {"elapsed_s", elapsed}}
                     .dump()
              << "\n";
      metrics.flush();
      std::vector<std::pair<std::string, double>> tbv = {
          {"train/loss", loss}, {"train/acc", acc}, {"train/tau_estimate", tau}, {"train/lr", st.lr},
          {"train/grad_norm", st.grad_norm}, {"perf/tokens_per_s", double(win_tokens) / dt},
          {"perf/samples_per_s", double(win_micro) / dt}};
      for (size_t k = first_slot; k < slot_acc.size(); ++k) tbv.emplace_back("slot_acc/" + std::to_string(k), slot_acc[k]);
      if (tb) tb->scalars(s, tbv);
      win_micro = win_tokens = win_loss_n = 0;
      win_loss = 0;
      std::fill(win_correct.begin(), win_correct.end(), 0);
      std::fill(win_count.begin(), win_count.end(), 0);
      t_win = Clock::now();
    }
    if (c.eval_every > 0 && s % c.eval_every == 0 && s < total && !st.skipped) evaluate(s);
    if (!st.skipped) ++stages.steps;
    if (stages.steps >= c.stages_every) {
      stages.wall_s = secs_since(t_stage);
      if (leader) fmt::print("{}\n", stage_report(stages, tr.backend().device()));
      if (power.available()) fmt::print("{}\n", power_report(gpus, power.take(), stages.steps));
      stages = {};
      stages.overlap = disaggregated;
      t_stage = Clock::now();
    }
    if (s != last_saved && s % c.save_every == 0 && s < total) {
      const fs::path dir = save_checkpoint();
      if (leader) fmt::print("train: checkpoint {}\n", dir.string());
      last_saved = s;
      power.take();  // the GPUs idled while it was written: not part of the next window
    }
    if (const int sig = sig_any) {
      const fs::path dir = save_checkpoint();
      if (leader) fmt::print("train: interrupted (signal {}); checkpoint {} written; continue with --resume\n", sig, dir.string());
      return 128 + sig;
    }
    if (c.steps_this_run > 0 && s - step0 >= c.steps_this_run && s < total) {
      const fs::path dir = save_checkpoint();
      if (leader) fmt::print("train: stopping after {} steps (--steps-this-run); checkpoint {}; continue with --resume\n",
                 s - step0, dir.string());
      return 0;
    }
  }
  const fs::path final_dir = out / "final";
  evaluate(tr.step_count());
  if (leader) {
    tr.save(final_dir.string());
    fmt::print("train: done: {} steps in {}, {} skipped; the drafter is in {}\n", tr.step_count(),
               duration_str(secs_since(t_start)), skipped_total, final_dir.string());
    // A GGUF target trains here only: the servers take its Hugging Face checkpoint.
    const bool gguf = fs::path(c.target).extension() == ".gguf";
    fmt::print("train: serve it beside {}:\n{}", gguf ? "the Hugging Face checkpoint of this GGUF's model" : "the target",
               serving_commands(gguf ? "HF_TARGET" : fs::absolute(c.target).lexically_normal().string(),
                                fs::absolute(final_dir).lexically_normal().string(), dc));
  }
  return 0;
}

}  // namespace dflash
