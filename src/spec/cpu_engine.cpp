// The CPU reference decoding engine and drafter (src/spec/decoder.h).
#include <algorithm>
#include <stdexcept>

#include "spec/decoder.h"

#include "models/dspark.h"
#include "ops/linear.h"

namespace dflash {

namespace {

class CpuDecoder final : public TargetDecoder {
 public:
  CpuDecoder(const TargetModel& m, std::vector<int64_t> taps) : m_(m), taps_(std::move(taps)), cache_(m.spec(), 0) {
    check_tap_layer_ids(m.spec(), taps_);
  }
  const ModelSpec& spec() const override { return m_.spec(); }
  void reset(int n) override { cache_ = TargetCache(m_.spec(), n); }
  void clear(int s) override { cache_.clear(s); }

  std::vector<DecodeOutput> feed(const std::vector<std::vector<int32_t>>& tokens, bool keep_rollback,
                                 bool logits) override {
    if (int(tokens.size()) != cache_.num_seqs())
      throw std::invalid_argument("decoder: fed " + std::to_string(tokens.size()) + " sequences, the batch has " +
                                  std::to_string(cache_.num_seqs()));
    std::vector<int32_t> ids;
    std::vector<int64_t> cu;
    pack_feed(tokens, &ids, &cu);
    ForwardOptions fo;
    fo.hidden_states = tap_hidden_states(taps_);
    fo.keep_rollback = keep_rollback;
    return split_feed_output(m_.forward(ids, cu, fo, &cache_), cu, taps_, nullptr, logits);
  }
  void rollback(int s, int64_t length) override { cache_.rollback(s, length); }
  int64_t length(int s) const override { return cache_.length(s); }
  std::string describe() const override { return "cpu reference (fp32)"; }

 private:
  const TargetModel& m_;
  std::vector<int64_t> taps_;
  TargetCache cache_;
};

class CpuDrafter final : public BlockDrafter {
 public:
  CpuDrafter(const DrafterConfig& c, DrafterWeights<float> w, const Tensor& embed, const Tensor& lm_head)
      : c_(c), w_(std::move(w)), embed_(embed), lm_head_(lm_head) {}
  const DrafterConfig& config() const override { return c_; }
  void reset(int n) override { ctx_.assign(size_t(n), DrafterContextCache{}); }
  void clear(int s) override { ctx_.at(size_t(s)) = DrafterContextCache{}; }
  void append_context(int s, const Tensor& taps) override { drafter_extend_context(c_, w_, ctx_.at(size_t(s)), taps); }
  std::vector<std::vector<int32_t>> draft(const std::vector<int32_t>& last) override {
    std::vector<std::vector<int32_t>> r(last.size());
    for (size_t s = 0; s < last.size(); ++s) {
      if (last[s] < 0) continue;
      const Tensor h = drafter_draft_hidden(c_, w_, ctx_.at(s), last[s], embed_);  // [B, d]
      if (c_.is_dspark()) {  // every slot drafts, along the Markov walk
        r[s] = dspark_greedy_drafts(w_, h, last[s], lm_head_);
        continue;
      }
      const Tensor logits = cpu::linear(h, lm_head_, "lm_head");  // [B, V]
      const int64_t V = logits.dim(1);
      for (int64_t k = 1; k < c_.block_size; ++k)
        r[s].push_back(int32_t(std::max_element(logits.row(k), logits.row(k) + V) - logits.row(k)));
    }
    return r;
  }
  std::string describe() const override { return "cpu reference drafter (fp32, context keys / values cached)"; }

 private:
  DrafterConfig c_;
  DrafterWeights<float> w_;
  const Tensor& embed_;
  const Tensor& lm_head_;
  std::vector<DrafterContextCache> ctx_;  // per sequence
};

}  // namespace

void check_tap_layer_ids(const ModelSpec& s, const std::vector<int64_t>& taps) {
  for (int64_t id : taps)
    if (id < 0 || id >= s.num_hidden_layers)
      throw std::invalid_argument("decoder: tap layer id " + std::to_string(id) + " is outside the target's " +
                                  std::to_string(s.num_hidden_layers) + " layers");
}

void pack_feed(const std::vector<std::vector<int32_t>>& tokens, std::vector<int32_t>* ids, std::vector<int64_t>* cu) {
  ids->clear();
  *cu = {0};
  for (const auto& t : tokens) {
    ids->insert(ids->end(), t.begin(), t.end());
    cu->push_back(int64_t(ids->size()));
  }
}

std::vector<DecodeOutput> split_feed_output(const ForwardOutput& f, const std::vector<int64_t>& cu,
                                            const std::vector<int64_t>& taps, const std::vector<int32_t>* argmax,
                                            bool logits) {
  const Tensor all_taps = concat_taps(f, taps);
  std::vector<DecodeOutput> r(cu.size() - 1);
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    if (argmax) {
      r[s].argmax.assign(argmax->begin() + cu[s], argmax->begin() + cu[s + 1]);
    } else {
      const int64_t V = f.logits.dim(1);
      for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
        r[s].argmax.push_back(int32_t(std::max_element(f.logits.row(t), f.logits.row(t) + V) - f.logits.row(t)));
    }
    if (logits) r[s].logits = slice_rows(f.logits, cu[s], cu[s + 1]);
    if (all_taps.numel()) r[s].taps = slice_rows(all_taps, cu[s], cu[s + 1]);
  }
  return r;
}

std::unique_ptr<TargetDecoder> make_cpu_decoder(const TargetModel& model, std::vector<int64_t> tap_layer_ids) {
  return std::make_unique<CpuDecoder>(model, std::move(tap_layer_ids));
}

std::unique_ptr<BlockDrafter> make_cpu_drafter(const DrafterConfig& cfg, DrafterWeights<float> weights,
                                               const Tensor& embed, const Tensor& lm_head) {
  return std::make_unique<CpuDrafter>(cfg, std::move(weights), embed, lm_head);
}

}  // namespace dflash
