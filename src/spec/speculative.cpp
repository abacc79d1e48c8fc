#include "spec/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

#include "common/clock.h"

namespace dflash {

namespace {

/// Chooses tokens from logit rows: argmax at temperature 0, else samples softmax(logits / T).
class Chooser {
 public:
  Chooser(double temperature, uint64_t seed, int n) : t_(temperature) {
    for (int s = 0; s < n; ++s) {
      std::seed_seq seq{seed, uint64_t(s)};  // one stream per prompt, whatever the batching
      rng_.emplace_back(seq);
    }
  }
  bool greedy() const { return t_ <= 0; }
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
  /// The token after fed token `row` of `d`.
  int32_t choose(int s, const DecodeOutput& d, int64_t row) {
    if (greedy()) return d.argmax.at(size_t(row));
    probs(d.logits.row(row), d.logits.dim(1), p_);
    return draw(s, p_);
  }
  /// Verifies drafts against the target's rows of d (row k predicts the token after block token k):
  /// returns the number accepted and sets *next to the token committed after them.
  int verify(int s, const DecodeOutput& d, const std::vector<int32_t>& drafts, int32_t* next) {
    int acc = 0;
    for (; acc < int(drafts.size()); ++acc) {
      const int32_t t = drafts[size_t(acc)];
      if (greedy()) {
        if (d.argmax.at(size_t(acc)) != t) break;
        continue;
      }
      probs(d.logits.row(acc), d.logits.dim(1), p_);
      if (uniform(s) < p_[size_t(t)]) continue;  // accept with probability p(t) / q(t), q one-hot
      p_[size_t(t)] = 0;                          // residual max(0, p - q), renormalized by draw()
      *next = draw(s, p_);
      return acc;
    }
    *next = choose(s, d, acc);
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
  const int64_t B = drafter ? drafter->config().drafts_per_block() + 1 : 1;  // tokens fed per verify step
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
  Chooser chooser(o.temperature, o.seed, n);
  // Slots of the engine's batch; each holds one prompt at a time (continuous batching: a finished
  // sequence's slot takes the next prompt, whose prefill joins the other slots' decode step).
  const int S = o.max_batch > 0 ? std::min(n, o.max_batch) : n;
  struct Slot {
    int seq = -1;         // prompt index, -1: free
    bool prefill = false;  // its prompt is fed in the coming step
    int32_t last = 0;     // last committed token (fed next)
    std::chrono::steady_clock::time_point t0, t_first;
  };
  std::vector<Slot> slots(static_cast<size_t>(S));
  int next_prompt = 0;
  int64_t finished = 0;
  auto finish = [&](Slot& sl) {
    SequenceResult& q = r.seqs[size_t(sl.seq)];
    q.decode_ms = ms_since(sl.t_first);
    sl.seq = -1;
    if (o.on_finished) o.on_finished(++finished);
  };
  // Appends committed tokens to the slot's sequence; frees the slot at a stop token or max_new_tokens.
  auto commit = [&](Slot& sl, const std::vector<int32_t>& toks) {
    SequenceResult& q = r.seqs[size_t(sl.seq)];
    for (int32_t t : toks) {
      q.tokens.push_back(t);
      if (is_stop(t)) q.stopped = true;
      if (q.stopped || int64_t(q.tokens.size()) >= o.max_new_tokens) break;
    }
    sl.last = toks.back();
    if (q.stopped || int64_t(q.tokens.size()) >= o.max_new_tokens) finish(sl);
  };
  const auto t0 = std::chrono::steady_clock::now();
  target.reset(S);
  if (drafter) drafter->reset(S);
  std::vector<std::vector<int32_t>> feed(static_cast<size_t>(S)), drafts;
  std::vector<int32_t> want(static_cast<size_t>(S));
  // A slot near max_position_embeddings steps one token at a time (no draft) until the limit.
  auto drafting = [&](int i) { return drafter && target.length(i) + B <= limit; };
  while (true) {
    if (o.should_stop && o.should_stop()) throw std::runtime_error("interrupted");
    bool any = false;
    for (int i = 0; i < S; ++i) {
      Slot& sl = slots[size_t(i)];
      if (sl.seq >= 0 && !sl.prefill && target.length(i) + 1 > limit) {  // no room for another token
        r.seqs[size_t(sl.seq)].hit_context_limit = true;
        finish(sl);
      }
      if (sl.seq < 0 && next_prompt < n) {
        sl = Slot{next_prompt++, true, 0, std::chrono::steady_clock::now(), {}};
        target.clear(i);
        if (drafter) drafter->clear(i);
      }
      any = any || sl.seq >= 0;
      want[size_t(i)] = sl.seq >= 0 && !sl.prefill && drafting(i) ? sl.last : -1;
    }
    if (!any) break;
    if (drafter) drafts = drafter->draft(want);
    // Prompts (prefill) and blocks are fed apart: only a block keeps what a rollback needs (for
    // GatedDeltaNet layers a state per token, far too much for a whole prompt).
    std::vector<std::vector<int32_t>> pre(static_cast<size_t>(S));
    bool any_pre = false, any_step = false;
    for (int i = 0; i < S; ++i) {
      const Slot& sl = slots[size_t(i)];
      std::vector<int32_t>& f = feed[size_t(i)];
      f.clear();
      if (sl.seq < 0) continue;
      if (sl.prefill) {
        pre[size_t(i)] = prompts[size_t(sl.seq)];
        any_pre = true;
        continue;
      }
      any_step = true;
      f.push_back(sl.last);
      if (want[size_t(i)] >= 0) f.insert(f.end(), drafts[size_t(i)].begin(), drafts[size_t(i)].end());
    }
    std::vector<DecodeOutput> out = any_step ? target.feed(feed, drafter != nullptr, !chooser.greedy())
                                             : std::vector<DecodeOutput>(static_cast<size_t>(S));
    if (any_pre) {
      std::vector<DecodeOutput> po = target.feed(pre, false, !chooser.greedy());
      for (int i = 0; i < S; ++i)
        if (!pre[size_t(i)].empty()) out[size_t(i)] = std::move(po[size_t(i)]), feed[size_t(i)] = pre[size_t(i)];
    }
    for (int i = 0; i < S; ++i) {
      Slot& sl = slots[size_t(i)];
      if (sl.seq < 0) continue;
      const DecodeOutput& d = out[size_t(i)];
      if (drafter && d.taps.numel() == 0)
        throw std::invalid_argument("the target decoder returns no taps: create it with the drafter's target_layer_ids");
      if (sl.prefill) {
        sl.prefill = false;
        if (drafter) drafter->append_context(i, d.taps);
        const int32_t first = chooser.choose(sl.seq, d, int64_t(feed[size_t(i)].size()) - 1);
        sl.t_first = std::chrono::steady_clock::now();
        r.seqs[size_t(sl.seq)].ttft_ms = std::chrono::duration<double, std::milli>(sl.t_first - sl.t0).count();
        commit(sl, {first});
        continue;
      }
      if (feed[size_t(i)].size() == 1) {  // a plain step (no drafter, or no room for a block)
        if (drafter) drafter->append_context(i, d.taps);
        commit(sl, {chooser.choose(sl.seq, d, 0)});
        continue;
      }
      int32_t next = 0;
      const int acc = chooser.verify(sl.seq, d, drafts[size_t(i)], &next);
      // Keep block tokens 0..acc (last + accepted drafts); `next` is fed with the next block.
      target.rollback(i, target.length(i) - int64_t(feed[size_t(i)].size()) + acc + 1);
      drafter->append_context(i, slice_rows(d.taps, 0, acc + 1));
      std::vector<int32_t> toks(drafts[size_t(i)].begin(), drafts[size_t(i)].begin() + acc);
      toks.push_back(next);
      r.seqs[size_t(sl.seq)].accepted.push_back(acc);
      commit(sl, toks);
    }
  }
  r.wall_ms = ms_since(t0);
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
