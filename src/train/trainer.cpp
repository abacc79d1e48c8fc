#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "io/json_file.h"
#include "io/safetensors.h"
#include "models/drafter_checkpoint.h"
#include "train/anchors.h"

namespace dflash {

namespace {

constexpr const char* kStateFormat = "dflash-train-state-v1";

nlohmann::json options_json(const TrainerOptions& o) {
  nlohmann::json j = {{"num_anchors", o.num_anchors},     {"grad_accum", o.grad_accum},
          {"max_grad_norm", o.max_grad_norm}, {"gamma", o.gamma},
          {"peak_lr", o.schedule.peak_lr},    {"total_steps", o.schedule.total_steps},
          {"warmup_ratio", o.schedule.warmup_ratio}, {"beta1", o.adamw.beta1},
          {"beta2", o.adamw.beta2},           {"eps", o.adamw.eps},
          {"weight_decay", o.adamw.weight_decay}, {"shuffle", o.shuffle}};
  if (o.dpace) j["loss"] = "dpace";  // (absent for the gamma decay: earlier states resume)
  return j;
}

}  // namespace

DrafterTrainer::DrafterTrainer(DrafterConfig cfg, std::unique_ptr<DrafterBackend> backend, int64_t num_examples,
                               TrainerOptions opt)
    : cfg_(std::move(cfg)), backend_(std::move(backend)), num_examples_(num_examples), opt_(opt), rng_(opt.seed) {
  if (num_examples <= 0) throw std::invalid_argument("DrafterTrainer: no training examples");
  if (opt.grad_accum <= 0) throw std::invalid_argument("DrafterTrainer: grad_accum must be > 0");
  if (opt.num_anchors <= 0) throw std::invalid_argument("DrafterTrainer: num_anchors must be > 0");
  if (!backend_) throw std::invalid_argument("DrafterTrainer: no backend");
  make_order();
}

void DrafterTrainer::make_order() {
  order_.resize(size_t(num_examples_));
  for (int64_t i = 0; i < num_examples_; ++i) order_[size_t(i)] = i;
  if (!opt_.shuffle) return;
  // One RNG per epoch, derived from (seed, epoch): the order never depends on how far anchors went.
  std::mt19937_64 r(opt_.seed ^ (0x9E3779B97F4A7C15ull * uint64_t(pos_.epoch + 1)));
  for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[size_t(uniform_below(i, r))]);
}

int64_t DrafterTrainer::next_example() {
  if (pos_.index >= num_examples_) {
    ++pos_.epoch;
    pos_.index = 0;
    make_order();
  }
  return order_[size_t(pos_.index++)];
}

TrainStepStats DrafterTrainer::step(const SampleSource& source) {
  const DataPosition pos0 = pos_;
  const std::mt19937_64 rng0 = rng_;
  const int64_t B = cfg_.block_size;
  TrainStepStats st;
  st.slot_correct.assign(size_t(B), 0);
  st.slot_count.assign(size_t(B), 0);
  backend_->zero_grads();
  int64_t used = 0;
  double loss_sum = 0;
  try {
    // The step's samples and anchors first (in data order, one RNG), then the backend runs them
    // (in parallel where it has several replicas).
    std::vector<TrainSample> samples(static_cast<size_t>(opt_.grad_accum));
    std::vector<MicroBatch> mbs(samples.size());
    for (size_t m = 0; m < samples.size(); ++m) {
      const int64_t idx = next_example();
      try {
        samples[m] = source(idx);
      } catch (const std::exception& e) {
        throw std::runtime_error("training example " + std::to_string(idx) + ": " + e.what());
      }
      samples[m].index = idx;
      mbs[m] = {&samples[m], sample_anchors(samples[m].loss_mask, opt_.num_anchors, rng_)};
    }
    const std::vector<MicroResult> results = backend_->micro_steps(mbs, LossWeighting{opt_.gamma, opt_.dpace});
    for (size_t m = 0; m < results.size(); ++m) {  // unusable taps stop the run before any training on them
      if (results[m].tap_stats.empty()) continue;
      const std::string bad = tap_problem(results[m].tap_stats);
      if (!bad.empty())
        throw std::runtime_error("training example " + std::to_string(mbs[m].sample->index) +
                                 ": the target's taps are unusable: " + bad + " (" + tap_summary(results[m].tap_stats) +
                                 "). Check target_layer_ids against the target and its backend; nothing was trained");
      st.tap_stats.emplace_back(mbs[m].sample->index, results[m].tap_stats);
    }
    for (size_t m = 0; m < results.size(); ++m)
      if (results[m].nonfinite_taps)
        st.nonfinite += (st.nonfinite.empty() ? "" : "; ") + std::string("non-finite taps in example ") +
                        std::to_string(mbs[m].sample->index);
    for (const MicroResult& r : results) {
      ++st.micro_batches;
      st.target_ms += r.target_ms;
      st.drafter_ms += r.drafter_ms;
      st.queue_ms += r.queue_ms;
      if (!(r.weight_sum > 0)) {
        ++st.empty_micro_batches;
        continue;
      }
      ++used;
      loss_sum += r.loss;
      for (int64_t k = 0; k < B; ++k) {
        st.slot_correct[size_t(k)] += r.slot_correct[size_t(k)];
        st.slot_count[size_t(k)] += r.slot_count[size_t(k)];
      }
    }
    for (const TrainSample& s : samples) st.tokens += int64_t(s.ids.size());
  } catch (...) {
    const bool new_epoch = pos_.epoch != pos0.epoch;
    pos_ = pos0;
    rng_ = rng0;
    if (new_epoch) make_order();
    throw;
  }
  st.lr = opt_.schedule.lr(step_);
  if (used > 0) {
    st.loss = loss_sum / double(used);
    if (used > 1) backend_->scale_grads(1.0 / double(used));
    const auto t0 = std::chrono::steady_clock::now();
    const ClipResult clip = backend_->optimizer_step(opt_.adamw, st.lr, opt_.max_grad_norm, step_ + 1);
    st.optimizer_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    st.grad_norm = clip.norm;
    if (!std::isfinite(clip.norm)) {
      st.skipped = true;
      const std::string g = backend_->first_nonfinite_grad();
      st.nonfinite = (g.empty() ? "the gradient norm" : "the gradient of " + g) + " is not finite" +
                     (st.nonfinite.empty() ? "" : " (" + st.nonfinite + ")");
    } else {
      st.nonfinite.clear();
      ++step_;
    }
  } else {
    st.skipped = true;  // nothing to learn from: no update, the step count stays
  }
  st.step = step_;
  return st;
}

void DrafterTrainer::save(const std::string& dir) const {
  const OptimizerState os = backend_->state();
  write_drafter_checkpoint(dir, cfg_, os.weights, [&](const std::string& path) {
    std::vector<SafetensorsEntry> e;
    const auto named = os.weights.named();
    for (const auto& [name, t] : named) e.push_back({"master." + name, DType::F32, t->shape, t->data.data()});
    for (size_t i = 0; i < named.size(); ++i) {
      e.push_back({"exp_avg." + named[i].first, DType::F32, named[i].second->shape, os.exp_avg[i].data()});
      e.push_back({"exp_avg_sq." + named[i].first, DType::F32, named[i].second->shape, os.exp_avg_sq[i].data()});
    }
    std::ostringstream rng;
    rng << rng_;
    write_safetensors(path, e,
                      {{"format", kStateFormat},
                       {"step", std::to_string(step_)},
                       {"epoch", std::to_string(pos_.epoch)},
                       {"index", std::to_string(pos_.index)},
                       {"num_examples", std::to_string(num_examples_)},
                       {"seed", std::to_string(opt_.seed)},
                       {"rng_anchors", rng.str()},
                       {"options", options_json(opt_).dump()}});
  });
}

void DrafterTrainer::resume(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / kTrainingStateFile).string();
  if (!fs::exists(path)) throw std::runtime_error(path + ": no training state (not a checkpoint written by dflash train)");
  auto fail = [&](const std::string& m) { throw std::runtime_error(path + ": " + m); };
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  const DrafterConfig saved_cfg = drafter_config_from_json(read_json_file(cfg_path), cfg_path);
  if (drafter_config_to_json(saved_cfg) != drafter_config_to_json(cfg_))
    throw std::runtime_error(cfg_path + ": the checkpoint's drafter config differs from this run's");
  const SafetensorsFile f(path);
  const auto& meta = f.metadata();
  auto get = [&](const char* k) -> const std::string& {
    const auto it = meta.find(k);
    if (it == meta.end()) fail(std::string("metadata field '") + k + "' is missing");
    return it->second;
  };
  auto get_int = [&](const char* k) -> int64_t {
    const std::string& s = get(k);
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != s.size() || s.empty() || v < 0) fail(std::string("metadata field '") + k + "' is not a count: " + s);
    return v;
  };
  if (get("format") != kStateFormat) fail("unknown format '" + get("format") + "'");
  const int64_t step = get_int("step"), epoch = get_int("epoch"), index = get_int("index");
  if (get_int("num_examples") != num_examples_)
    fail("saved for " + get("num_examples") + " examples, this run has " + std::to_string(num_examples_) +
         " (the data order would differ)");
  if (get("seed") != std::to_string(opt_.seed)) fail("saved with seed " + get("seed") + ", this run uses " + std::to_string(opt_.seed));
  if (index > num_examples_) fail("data index " + std::to_string(index) + " is past the data");
  // The schedule, anchors and accumulation must be those of the saved run, or the resumed run is
  // not the run that was interrupted.
  nlohmann::json saved_opt;
  try {
    saved_opt = nlohmann::json::parse(get("options"));
  } catch (const nlohmann::json::exception&) {
    fail("metadata field 'options' is not JSON");
  }
  const nlohmann::json now = options_json(opt_);
  std::string diff;
  for (auto it = now.begin(); it != now.end(); ++it)
    if (!saved_opt.contains(it.key()) || saved_opt[it.key()] != it.value())
      diff += (diff.empty() ? "" : ", ") + it.key() + " " + (saved_opt.contains(it.key()) ? saved_opt[it.key()].dump() : "?") +
              " -> " + it.value().dump();
  if (!diff.empty()) fail("saved with other training settings (" + diff + "): resume with the settings of the saved run");
  std::mt19937_64 rng;
  std::istringstream rs(get("rng_anchors"));
  rs >> rng;
  if (!rs) fail("metadata field 'rng_anchors' is not an mt19937_64 state");

  DrafterWeights<float> w = drafter_zeros<float>(cfg_);
  auto read = [&](const std::string& name, std::span<float> out, const std::vector<int64_t>& shape) {
    const TensorInfo* info = f.find(name);
    if (!info) fail("missing tensor '" + name + "'");
    if (info->dtype != DType::F32 || info->shape != shape)
      fail("tensor '" + name + "' is " + dtype_name(info->dtype) + " " + shape_str(info->shape) + ", expected F32 " +
           shape_str(shape));
    std::memcpy(out.data(), f.data(name), out.size() * sizeof(float));
  };
  std::vector<std::vector<float>> m, v;
  for (auto& [name, t] : w.named()) {
    read("master." + name, t->data, t->shape);
    m.emplace_back(t->data.size());
    v.emplace_back(t->data.size());
    read("exp_avg." + name, m.back(), t->shape);
    read("exp_avg_sq." + name, v.back(), t->shape);
  }
  if (f.tensors().size() != 3 * w.named().size()) fail("holds tensors that are not part of this drafter's state");
  for (const auto& [name, t] : w.named())
    for (float x : t->data)
      if (!std::isfinite(x)) fail("master weights of '" + name + "' hold a non-finite value");
  backend_->set_state({step, std::move(w), std::move(m), std::move(v)});
  step_ = step;
  rng_ = rng;
  pos_ = {epoch, index};
  make_order();
}

DrafterWeights<float> init_drafter_weights(const DrafterConfig& cfg, uint64_t seed, double std_dev) {
  DrafterWeights<float> w = drafter_zeros<float>(cfg);
  std::mt19937_64 rng(seed);
  auto unit = [&] { return (double(rng() >> 11) + 0.5) * 0x1.0p-53; };  // (0, 1)
  for (auto& [name, t] : w.named()) {
    // DSpark starts as its backbone alone: no Markov bias (W2 = 0) and a confidence bias of 0.
    if (name == "markov_head.markov_w2.weight" || name == "confidence_head.proj.bias") continue;
    if (t->ndim() == 1) {
      for (float& x : t->data) x = 1.0f;
      continue;
    }
    for (float& x : t->data) {
      const double u1 = unit(), u2 = unit();
      x = float(std_dev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
    }
  }
  return w;
}

}  // namespace dflash
