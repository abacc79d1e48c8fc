// Byte-level BPE merging with exactly the results of tokenizers' BPE model (internal).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dflash::text {

/// One token of a word: its id and how many bytes of the word it covers.
struct BpePiece {
  int32_t id;
  uint32_t len;
};

/// One merge rule: left and right ids merge into `result`; lower rank merges first.
struct BpeMerge {
  int32_t left, right, result;
};

/// Merge rules keyed by the pair of ids: open addressing, linear probing.
class BpeMergeTable {
 public:
  /// Rules in rank order (index = rank); a pair listed twice keeps its last rank, as tokenizers does.
  explicit BpeMergeTable(const std::vector<BpeMerge>& merges);
  /// Rank and result of merging (left, right); false when they do not merge.
  bool find(int32_t left, int32_t right, int32_t* rank, int32_t* result) const {
    const uint64_t key = pack(left, right);
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      const Entry& e = table_[i];
      if (e.key == key) {
        *rank = e.rank;
        *result = e.result;
        return true;
      }
      if (e.key == kEmpty) return false;
    }
  }

 private:
  struct Entry {
    uint64_t key;
    int32_t rank, result;
  };
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  static uint64_t pack(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  std::size_t slot(uint64_t key) const { return std::size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Entry> table_;
  std::size_t mask_ = 0;
  int shift_ = 64;
};

/// Words already merged -> their tokens, for one thread (not thread-safe). Open addressing over a
/// flat table with the word bytes and tokens in two arenas; when half full it starts over.
class BpeWordCache {
 public:
  BpeWordCache();
  static uint64_t hash(std::string_view word);  // never 0
  /// Appends the cached tokens of `word` (hash `h`) to `out`; false when it is not cached.
  bool find(std::string_view word, uint64_t h, std::vector<BpePiece>& out) const;
  void insert(std::string_view word, uint64_t h, const BpePiece* pieces, std::size_t n);

 private:
  struct Slot {
    uint64_t hash = 0;  // 0: empty
    uint32_t key = 0, val = 0;
    uint16_t key_len = 0, val_len = 0;
  };
  static constexpr std::size_t kSlots = std::size_t(1) << 15;
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<BpePiece> vals_;
  std::size_t used_ = 0;
};

/// The BPE model over bytes: a word (bytes of one pre-tokenized piece) starts as one symbol per byte
/// (the vocabulary id of the byte's byte-level character) and is merged pair by pair, lowest rank
/// first and leftmost first among equal ranks. Immutable apart from its word caches, one per
/// thread: encode_word is safe from many threads at once.
class BpeModel {
 public:
  struct Options {
    /// Id per byte of its byte-level character's token (-1: not in the vocabulary).
    std::array<int32_t, 256> byte_ids{};
    /// With byte_fallback: per byte, the ids of the "<0xXX>" tokens of the UTF-8 bytes of its
    /// byte-level character (tokenizers falls back on the character's bytes, not the input byte);
    /// count 0 when one of them is not in the vocabulary.
    std::array<std::array<int32_t, 2>, 256> fallback_ids{};
    std::array<uint8_t, 256> fallback_count{};
    std::optional<int32_t> unk_id;
    bool byte_fallback = false, fuse_unk = false;
    /// ignore_merges: a whole word found in `whole_words` (raw bytes -> id) is one token.
    bool ignore_merges = false;
    std::unordered_map<std::string, int32_t> whole_words;
  };
  BpeModel(Options opt, const std::vector<BpeMerge>& merges);

  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  /// The calling thread's word cache for this model (made on first use; a thread drops the caches
  /// of models that no longer exist when it makes a new one).
  BpeWordCache& thread_cache() const;
  /// Appends the tokens of `word` (non-empty) to `out`, from `cache` (the calling thread's
  /// thread_cache()) when it has them.
  void encode_word(std::string_view word, std::vector<BpePiece>& out, BpeWordCache& cache) const;
  /// The same without the cache.
  void merge_word(std::string_view word, std::vector<BpePiece>& out) const;

 private:
  void merge_small(std::vector<BpePiece>& sym) const;
  void merge_large(std::vector<BpePiece>& sym) const;

  Options opt_;
  BpeMergeTable merges_;

  static constexpr std::size_t kMaxCachedWord = 256;
  uint64_t id_;                       // unique per model, keys the thread caches
  std::shared_ptr<const int> alive_;  // expires with the model
};

}  // namespace dflash::text
