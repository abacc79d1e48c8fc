// Finding added tokens in text (internal): tokenizers' AddedVocabulary split, which uses an
// Aho-Corasick automaton with leftmost-longest matching: at the leftmost position where any token
// occurs the longest one there wins, and the search goes on after it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::text {

class AddedTokenMatcher {
 public:
  /// Adds a token (non-empty content); a content added twice keeps the later id.
  void add(const std::string& content, int32_t id);
  bool empty() const { return nodes_.size() <= 1; }

  struct Match {
    std::size_t begin, end;
    int32_t id;
  };
  /// The first match in text[from, ...), or false.
  bool find(std::string_view text, std::size_t from, Match* m) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;  // sorted by byte
    int32_t id = -1;                                      // token ending here
  };
  int32_t child(int32_t node, unsigned char c) const;
  std::vector<Node> nodes_{Node{}};
  bool first_[256] = {};
};

}  // namespace dflash::text
