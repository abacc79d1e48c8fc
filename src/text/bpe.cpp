#include "text/bpe.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <queue>

namespace dflash::text {

BpeMergeTable::BpeMergeTable(const std::vector<BpeMerge>& merges) {
  std::size_t cap = 16;
  shift_ = 60;
  while (cap < merges.size() * 2) {
    cap <<= 1;
    --shift_;
  }
  mask_ = cap - 1;
  table_.assign(cap, Entry{kEmpty, 0, 0});
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const uint64_t key = pack(merges[r].left, merges[r].right);
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      Entry& e = table_[i];
      if (e.key == kEmpty || e.key == key) {  // a repeated pair takes its later rank
        e = Entry{key, int32_t(r), merges[r].result};
        break;
      }
    }
  }
}

BpeWordCache::BpeWordCache() : slots_(kSlots) {}

uint64_t BpeWordCache::hash(std::string_view w) {
  uint64_t h = 0x243F6A8885A308D3ull ^ w.size();
  std::size_t i = 0;
  for (; i + 8 <= w.size(); i += 8) {
    uint64_t x;
    std::memcpy(&x, w.data() + i, 8);
    h = (h ^ x) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  uint64_t x = 0;
  std::memcpy(&x, w.data() + i, w.size() - i);
  h = (h ^ x) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  return h | 1;
}

bool BpeWordCache::find(std::string_view w, uint64_t h, std::vector<BpePiece>& out) const {
  for (std::size_t i = h & (kSlots - 1);; i = (i + 1) & (kSlots - 1)) {
    const Slot& s = slots_[i];
    if (s.hash == 0) return false;
    if (s.hash == h && s.key_len == w.size() && std::memcmp(keys_.data() + s.key, w.data(), w.size()) == 0) {
      out.insert(out.end(), vals_.begin() + s.val, vals_.begin() + s.val + s.val_len);
      return true;
    }
  }
}

void BpeWordCache::insert(std::string_view w, uint64_t h, const BpePiece* p, std::size_t n) {
  if (used_ >= kSlots / 2) {  // start over
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    vals_.clear();
    used_ = 0;
  }
  std::size_t i = h & (kSlots - 1);
  while (slots_[i].hash != 0) i = (i + 1) & (kSlots - 1);
  slots_[i] = Slot{h, uint32_t(keys_.size()), uint32_t(vals_.size()), uint16_t(w.size()), uint16_t(n)};
  keys_.append(w);
  vals_.insert(vals_.end(), p, p + n);
  ++used_;
}

namespace {
std::atomic<uint64_t> next_model_id{1};
}  // namespace

BpeModel::BpeModel(Options opt, const std::vector<BpeMerge>& merges)
    : opt_(std::move(opt)), merges_(merges), id_(next_model_id++), alive_(std::make_shared<const int>(0)) {}

BpeWordCache& BpeModel::thread_cache() const {
  struct Entry {
    uint64_t model;
    std::weak_ptr<const int> alive;
    std::unique_ptr<BpeWordCache> cache;
  };
  thread_local std::vector<Entry> caches;
  for (auto& e : caches)
    if (e.model == id_) return *e.cache;
  std::erase_if(caches, [](const Entry& e) { return e.alive.expired(); });
  caches.push_back({id_, alive_, std::make_unique<BpeWordCache>()});
  return *caches.back().cache;
}

void BpeModel::merge_word(std::string_view word, std::vector<BpePiece>& out) const {
  if (opt_.ignore_merges) {
    if (auto it = opt_.whole_words.find(std::string(word)); it != opt_.whole_words.end()) {
      out.push_back({it->second, uint32_t(word.size())});
      return;
    }
  }
  // Initial symbols, as tokenizers' BPE::merge_word: a byte without a token falls back on "<0xXX>"
  // tokens (byte_fallback), else becomes the unknown token (consecutive ones fused with fuse_unk),
  // else is dropped. Note that tokenizers adds a pending unknown token only when the next known
  // byte comes, after any fallback tokens in between.
  std::vector<BpePiece> sym;
  sym.reserve(word.size());
  bool pending = false;
  BpePiece unk{0, 0};
  for (unsigned char b : word) {
    const int32_t id = opt_.byte_ids[b];
    if (id >= 0) {
      if (pending) sym.push_back(unk);
      pending = false;
      sym.push_back({id, 1});
      continue;
    }
    if (opt_.byte_fallback && opt_.fallback_count[b] > 0) {
      for (int k = 0; k < opt_.fallback_count[b]; ++k) sym.push_back({opt_.fallback_ids[b][k], k == 0 ? 1u : 0u});
      continue;
    }
    if (!opt_.unk_id) continue;
    if (pending && opt_.fuse_unk) {
      ++unk.len;
    } else {
      if (pending) sym.push_back(unk);
      unk = {*opt_.unk_id, 1};
      pending = true;
    }
  }
  if (pending) sym.push_back(unk);
  if (sym.size() > 1) {
    if (sym.size() <= 128)
      merge_small(sym);
    else
      merge_large(sym);
  }
  out.insert(out.end(), sym.begin(), sym.end());
}

// O(n^2) in the worst case but with tiny constants: the rank of every adjacent pair is kept, the
// lowest (leftmost on ties) is merged and only its two neighbouring pairs are looked up again.
void BpeModel::merge_small(std::vector<BpePiece>& sym) const {
  std::size_t n = sym.size();
  int32_t rank[128], result[128];
  auto look = [&](std::size_t i) {
    if (!merges_.find(sym[i].id, sym[i + 1].id, &rank[i], &result[i])) rank[i] = INT_MAX;
  };
  for (std::size_t i = 0; i + 1 < n; ++i) look(i);
  while (n > 1) {
    std::size_t best = 0;
    int32_t best_rank = rank[0];
    for (std::size_t i = 1; i + 1 < n; ++i)
      if (rank[i] < best_rank) {
        best_rank = rank[i];
        best = i;
      }
    if (best_rank == INT_MAX) break;
    sym[best].id = result[best];
    sym[best].len += sym[best + 1].len;
    for (std::size_t i = best + 1; i + 1 < n; ++i) {
      sym[i] = sym[i + 1];
      rank[i] = rank[i + 1];
      result[i] = result[i + 1];
    }
    --n;
    if (best > 0) look(best - 1);
    if (best + 1 < n) look(best);
  }
  sym.resize(n);
}

// tokenizers' Word::merge_all: a heap of candidate merges (rank, position), stale entries skipped.
void BpeModel::merge_large(std::vector<BpePiece>& sym) const {
  const std::size_t n = sym.size();
  std::vector<int32_t> prev(n), next(n);
  for (std::size_t i = 0; i < n; ++i) {
    prev[i] = int32_t(i) - 1;
    next[i] = i + 1 < n ? int32_t(i + 1) : -1;
  }
  struct Cand {
    int32_t rank, pos, result;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t i) {
    const int32_t j = next[i];
    int32_t r, res;
    if (j >= 0 && merges_.find(sym[i].id, sym[j].id, &r, &res)) heap.push({r, i, res});
  };
  for (std::size_t i = 0; i + 1 < n; ++i) push(int32_t(i));
  std::vector<bool> dead(n, false);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    if (dead[c.pos] || next[c.pos] < 0) continue;
    const int32_t j = next[c.pos];
    int32_t r, res;
    if (!merges_.find(sym[c.pos].id, sym[j].id, &r, &res) || r != c.rank || res != c.result) continue;
    sym[c.pos].id = res;
    sym[c.pos].len += sym[j].len;
    dead[j] = true;
    next[c.pos] = next[j];
    if (next[j] >= 0) prev[next[j]] = c.pos;
    if (prev[c.pos] >= 0) push(prev[c.pos]);
    push(c.pos);
  }
  std::size_t k = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (!dead[i]) sym[k++] = sym[i];
  sym.resize(k);
}

void BpeModel::encode_word(std::string_view word, std::vector<BpePiece>& out, BpeWordCache& cache) const {
  if (word.size() == 1) {
    const int32_t id = opt_.byte_ids[static_cast<unsigned char>(word[0])];
    if (id >= 0 && !opt_.ignore_merges) {
      out.push_back({id, 1});
      return;
    }
  }
  if (word.size() > kMaxCachedWord) {
    merge_word(word, out);
    return;
  }
  const uint64_t h = BpeWordCache::hash(word);
  if (cache.find(word, h, out)) return;
  const std::size_t start = out.size();
  merge_word(word, out);
  cache.insert(word, h, out.data() + start, out.size() - start);
}

}  // namespace dflash::text
