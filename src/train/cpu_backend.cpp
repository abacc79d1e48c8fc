// The CPU reference training backend: drafter_step (fp32) + AdamW<float>.
#include <chrono>
#include <cmath>
#include <utility>
#include <stdexcept>

#include "train/backend.h"
#include "common/clock.h"

namespace dflash {

namespace {

std::vector<NamedSpan<float>> spans(DrafterWeights<float>& w) {
  std::vector<NamedSpan<float>> r;
  for (auto& [name, t] : w.named()) r.push_back({name, std::span<float>(t->data)});
  return r;
}

std::vector<NamedSpan<const float>> const_spans(const DrafterWeights<float>& w) {
  std::vector<NamedSpan<const float>> r;
  for (const auto& [name, t] : w.named()) r.push_back({name, std::span<const float>(t->data)});
  return r;
}

}  // namespace

std::string first_nonfinite(const DrafterWeights<float>& w) {
  for (const auto& [name, t] : w.named())
    for (float x : t->data)
      if (!std::isfinite(x)) return name;
  return "";
}

namespace {

class CpuBackend final : public DrafterBackend {
 public:
  CpuBackend(const DrafterConfig& cfg, DrafterWeights<float> w, const Tensor* embed, const Tensor* lm_head, TapsFn taps)
      : cfg_(cfg), w_(std::move(w)), embed_(embed), lm_head_(lm_head), taps_(std::move(taps)), adam_(spans(w_)),
        acc_(drafter_zeros<float>(cfg)) {
    if (!embed || !lm_head || !taps_) throw std::invalid_argument("cpu backend: embed, lm_head and taps are required");
    const auto shapes = drafter_param_shapes(cfg_);
    const auto named = w_.named();
    if (named.size() != shapes.size()) throw std::invalid_argument("cpu backend: weights do not match the config");
    for (size_t i = 0; i < named.size(); ++i)
      if (named[i].first != shapes[i].first || named[i].second->shape != shapes[i].second)
        throw std::invalid_argument("cpu backend: " + named[i].first + " has shape " +
                                    shape_str(named[i].second->shape) + ", expected " + shape_str(shapes[i].second));
  }

  void zero_grads() override {
    for (auto& s : spans(acc_)) std::fill(s.data.begin(), s.data.end(), 0.f);
  }

  MicroResult micro_step(const TrainSample& s, const std::vector<int64_t>& anchors, const LossWeighting& loss) override {
    if (s.loss_mask.size() != s.ids.size())
      throw std::invalid_argument("loss_mask has " + std::to_string(s.loss_mask.size()) + " entries for " +
                                  std::to_string(s.ids.size()) + " tokens");
    MicroResult r;
    auto t0 = std::chrono::steady_clock::now();
    Tensor taps = taps_(s), final_hidden;
    r.target_ms = ms_since(t0);
    // The captured rows, whole (the final hidden state of a DSpark drafter's too): their shape, NaN / Inf,
    // and on the first micro-batches the numbers of every captured layer.
    const std::vector<int64_t> layers = captured_layer_ids(cfg_);
    const int64_t S = int64_t(s.ids.size()), width = int64_t(layers.size()) * cfg_.hidden_size;
    if (taps.shape != std::vector<int64_t>{S, width})
      throw std::invalid_argument("the target's taps have shape " + shape_str(taps.shape) + ", expected " +
                                  shape_str({S, width}));
    for (float x : taps.data) r.nonfinite_taps = r.nonfinite_taps || !std::isfinite(x);
    if (taps_checked_ < kTapCheckedMicroBatches) {
      ++taps_checked_;
      r.tap_stats = tap_stats(taps.ptr(), S, layers, cfg_.hidden_size);
    }
    if (cfg_.is_dspark()) {  // each captured row: [taps (K d) | the target's final hidden state (d)]
      const int64_t d = cfg_.hidden_size, Kd = int64_t(cfg_.target_layer_ids.size()) * d;
      Tensor t({S, Kd});
      final_hidden = Tensor({S, d});
      for (int64_t i = 0; i < S; ++i) {
        std::copy_n(taps.row(i), Kd, t.row(i));
        std::copy_n(taps.row(i) + Kd, d, final_hidden.row(i));
      }
      taps = std::move(t);
    }
    t0 = std::chrono::steady_clock::now();
    DrafterSequence<float> seq;
    seq.taps = &taps;
    seq.ids = s.ids;
    seq.loss_mask.assign(s.loss_mask.begin(), s.loss_mask.end());
    seq.anchors = anchors;
    seq.num_blocks = int64_t(anchors.size());
    seq.embed = embed_;
    seq.lm_head = lm_head_;
    if (cfg_.is_dspark()) seq.target_hidden = &final_hidden;
    seq.gamma = loss.gamma, seq.dpace = loss.dpace;
    const DrafterStepResult<float> d = drafter_step(cfg_, w_, seq);
    r.loss = double(d.loss);
    r.weight_sum = double(d.weight_sum);
    r.slot_correct = d.slot_correct;
    r.slot_count = d.slot_count;
    if (d.weight_sum > 0) accumulate_scaled(spans(acc_), const_spans(d.grads), 1.0);
    r.drafter_ms = ms_since(t0);
    return r;
  }

  std::string first_nonfinite_grad() const override { return first_nonfinite(acc_); }

  void scale_grads(double f) override {
    const float x = float(f);
    for (auto& s : spans(acc_))
      for (float& g : s.data) g *= x;
  }

  ClipResult optimizer_step(const AdamWOptions& o, double lr, double max_norm, int64_t t) override {
    if (t != adam_.step_count() + 1)
      throw std::logic_error("cpu backend: optimizer step " + std::to_string(t) + " after " +
                             std::to_string(adam_.step_count()));
    const ClipResult c = clip_grad_norm(spans(acc_), max_norm);
    if (!std::isfinite(c.norm)) return c;
    adam_.options() = o;
    adam_.step(spans(w_), const_spans(acc_), lr);
    return c;
  }

  OptimizerState state() const override { return {adam_.step_count(), w_, adam_.exp_avg(), adam_.exp_avg_sq()}; }

  void set_state(const OptimizerState& s) override {
    const auto a = s.weights.named();
    const auto b = std::as_const(w_).named();
    if (a.size() != b.size()) throw std::invalid_argument("cpu backend: state holds a different drafter");
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].second->shape != b[i].second->shape)
        throw std::invalid_argument("cpu backend: state tensor " + a[i].first + " has another shape");
    adam_.set_state(s.step, s.exp_avg, s.exp_avg_sq);
    w_ = s.weights;
  }

  std::string device() const override { return "cpu"; }

 private:
  DrafterConfig cfg_;
  DrafterWeights<float> w_;
  const Tensor* embed_;
  const Tensor* lm_head_;
  TapsFn taps_;
  int taps_checked_ = 0;  // micro-batches whose taps were checked
  AdamW<float> adam_;
  DrafterGrads<float> acc_;
};

}  // namespace

std::unique_ptr<DrafterBackend> make_cpu_backend(const DrafterConfig& cfg, DrafterWeights<float> weights,
                                                 const Tensor* embed, const Tensor* lm_head, TapsFn taps) {
  return std::make_unique<CpuBackend>(cfg, std::move(weights), embed, lm_head, std::move(taps));
}

}  // namespace dflash
