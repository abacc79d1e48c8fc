#include "spec/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

namespace dflash {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// Chooses tokens from logit rows: argmax at temperature 0, else samples softmax(logits / T).
class Chooser {
 public:
  Chooser(double temperature, uint64_t seed, int n) : t_(temperature) {
    for (int s = 0; s < n; ++s) {
      std::seed_seq seq{seed, uint64_t(s)};
      rng_.emplace_back(seq);
    }
  }
  bool greedy() const { return t_ <= 0; }
  static int32_t argmax(const float* row, int64_t V) { return int32_t(std::max_element(row, row + V) - row); }
  /// softmax(row / T) into p.
  void probs(const float* row, int64_t V, std::vector<double>& p) const {
    const double mx = *std::max_element(row, row + V);
    p.resize(size_t(V));
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += (p[size_t(i)] = std::exp((double(row[i]) - mx) / t_));
    for (double& x : p) x /= sum;
  }
  double uniform(int s) { return std::uniform_real_distribution<double>(0, 1)(rng_[size_t(s)]); }
  /// A draw from the (unnormalized, non-negative) weights p.
  int32_t draw(int s, const std::vector<double>& p) {
    double total = 0;
    for (double x : p) total += x;
    double u = uniform(s) * total;
    for (size_t i = 0; i < p.size(); ++i)
      if ((u -= p[i]) < 0 && p[i] > 0) return int32_t(i);
    for (size_t i = p.size(); i-- > 0;)
      if (p[i] > 0) return int32_t(i);  // rounding left u >= 0: the last token with mass
    return 0;
  }
  int32_t choose(int s, const float* row, int64_t V) {
    if (greedy()) return argmax(row, V);
    probs(row, V, p_);
    return draw(s, p_);
  }
  /// Verifies drafts against the target rows logits[k] (row k predicts the token after block token k):
  /// returns the number accepted and sets *next to the token committed after them.
  int verify(int s, const Tensor& logits, const std::vector<int32_t>& drafts, int32_t* next) {
    const int64_t V = logits.dim(1);
    int acc = 0;
    for (; acc < int(drafts.size()); ++acc) {
      const float* row = logits.row(acc);
      const int32_t d = drafts[size_t(acc)];
      if (greedy()) {
        if (argmax(row, V) != d) break;
        continue;
      }
      probs(row, V, p_);
      if (uniform(s) < p_[size_t(d)]) continue;  // accept with probability p(d) / q(d), q one-hot
      p_[size_t(d)] = 0;                          // residual max(0, p - q), renormalized by draw()
      *next = draw(s, p_);
      return acc;
    }
    *next = choose(s, logits.row(acc), V);
    return acc;
  }

 private:
  double t_;
  std::vector<std::mt19937_64> rng_;
  std::vector<double> p_;
};

}  // namespace

GenerateResult generate(TargetDecoder& target, BlockDrafter* drafter, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateOptions& o) {
  const ModelSpec& spec = target.spec();
  const int n = int(prompts.size());
  const int64_t B = drafter ? drafter->config().block_size : 1;
  const int64_t limit = spec.max_position_embeddings > 0 ? spec.max_position_embeddings : INT64_MAX;
  if (o.max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be at least 1");
  if (drafter) check_drafter_fits(drafter->config(), spec, "drafter");
  for (int s = 0; s < n; ++s) {
    const auto& p = prompts[size_t(s)];
    if (p.empty()) throw std::invalid_argument("prompt " + std::to_string(s) + " is empty");
    for (int32_t t : p)
      if (t < 0 || t >= spec.vocab_size)
        throw std::invalid_argument("prompt " + std::to_string(s) + ": token id " + std::to_string(t) +
                                    " is outside the target's vocabulary of " + std::to_string(spec.vocab_size));
    if (int64_t(p.size()) + 1 > limit)
      throw std::invalid_argument("prompt " + std::to_string(s) + " has " + std::to_string(p.size()) +
                                  " tokens: no room to generate below the target's max_position_embeddings " +
                                  std::to_string(limit));
  }
  GenerateResult r;
  r.seqs.resize(size_t(n));
  if (n == 0) return r;
  auto is_stop = [&](int32_t t) {
    return std::find(o.stop_token_ids.begin(), o.stop_token_ids.end(), t) != o.stop_token_ids.end();
  };
  std::vector<int32_t> last(static_cast<size_t>(n));
  std::vector<bool> active(static_cast<size_t>(n), true);
  // Appends committed tokens to sequence s, ending it at a stop token or max_new_tokens.
  auto commit = [&](int s, const std::vector<int32_t>& toks) {
    SequenceResult& q = r.seqs[size_t(s)];
    for (int32_t t : toks) {
      q.tokens.push_back(t);
      if (is_stop(t)) q.stopped = true;
      if (q.stopped || int64_t(q.tokens.size()) >= o.max_new_tokens) break;
    }
    last[size_t(s)] = toks.back();
    active[size_t(s)] = !q.stopped && int64_t(q.tokens.size()) < o.max_new_tokens;
  };
  Chooser chooser(o.temperature, o.seed, n);

  const auto t0 = std::chrono::steady_clock::now();
  target.reset(n);
  if (drafter) drafter->reset(n);
  const std::vector<DecodeOutput> pre = target.feed(prompts, false);
  for (int s = 0; s < n; ++s) {
    const Tensor& lg = pre[size_t(s)].logits;
    if (drafter) {
      if (pre[size_t(s)].taps.numel() == 0)
        throw std::invalid_argument("the target decoder returns no taps: create it with the drafter's target_layer_ids");
      drafter->append_context(s, pre[size_t(s)].taps);
    }
    commit(s, {chooser.choose(s, lg.row(lg.dim(0) - 1), lg.dim(1))});
  }
  r.ttft_ms = ms_since(t0);
  const auto t1 = std::chrono::steady_clock::now();

  std::vector<std::vector<int32_t>> feed(static_cast<size_t>(n)), drafts;
  std::vector<int32_t> want(static_cast<size_t>(n));
  while (true) {
    bool any = false;
    for (int s = 0; s < n; ++s) {
      if (active[size_t(s)] && target.length(s) + B > limit) {
        active[size_t(s)] = false;
        r.seqs[size_t(s)].hit_context_limit = true;
      }
      any = any || active[size_t(s)];
      want[size_t(s)] = active[size_t(s)] ? last[size_t(s)] : -1;
    }
    if (!any) break;
    if (drafter) drafts = drafter->draft(want);
    for (int s = 0; s < n; ++s) {
      feed[size_t(s)].clear();
      if (!active[size_t(s)]) continue;
      feed[size_t(s)].push_back(last[size_t(s)]);
      if (drafter) feed[size_t(s)].insert(feed[size_t(s)].end(), drafts[size_t(s)].begin(), drafts[size_t(s)].end());
    }
    const std::vector<DecodeOutput> out = target.feed(feed, drafter != nullptr);
    for (int s = 0; s < n; ++s) {
      if (!active[size_t(s)]) continue;
      const DecodeOutput& d = out[size_t(s)];
      if (!drafter) {
        commit(s, {chooser.choose(s, d.logits.row(0), d.logits.dim(1))});
        continue;
      }
      int32_t next = 0;
      const int acc = chooser.verify(s, d.logits, drafts[size_t(s)], &next);
      // Keep block tokens 0..acc (last + accepted drafts); `next` is fed with the next block.
      target.rollback(s, target.length(s) - int64_t(feed[size_t(s)].size()) + acc + 1);
      drafter->append_context(s, slice_rows(d.taps, 0, acc + 1));
      std::vector<int32_t> toks(drafts[size_t(s)].begin(), drafts[size_t(s)].begin() + acc);
      toks.push_back(next);
      r.seqs[size_t(s)].accepted.push_back(acc);
      commit(s, toks);
    }
  }
  r.decode_ms = ms_since(t1);
  return r;
}

AcceptanceStats acceptance_stats(const std::vector<SequenceResult>& seqs, int64_t B) {
  AcceptanceStats a;
  a.block_size = B;
  a.histogram.assign(size_t(B + 1), 0);
  a.slot_accept.assign(size_t(B), 0.0);
  double sum = 0;
  for (const auto& q : seqs)
    for (int acc : q.accepted) {
      ++a.steps;
      sum += acc + 1;
      ++a.histogram[size_t(std::min<int64_t>(acc + 1, B))];
      for (int k = 1; k <= acc && k < B; ++k) a.slot_accept[size_t(k)] += 1;
    }
  if (a.steps) {
    a.tau = sum / double(a.steps);
    a.slot_accept[0] = 1;
    for (int64_t k = 1; k < B; ++k) a.slot_accept[size_t(k)] /= double(a.steps);
  }
  return a;
}

}  // namespace dflash
