#include "text/tokenizer_added.h"

#include <algorithm>

namespace dflash::text {

int32_t AddedTokenMatcher::child(int32_t node, unsigned char c) const {
  const auto& nx = nodes_[std::size_t(node)].next;
  for (const auto& [b, n] : nx)
    if (b == c) return n;
  return -1;
}

void AddedTokenMatcher::add(const std::string& content, int32_t id) {
  if (content.empty()) return;
  int32_t node = 0;
  for (unsigned char c : content) {
    int32_t n = child(node, c);
    if (n < 0) {
      n = int32_t(nodes_.size());
      nodes_.emplace_back();
      auto& nx = nodes_[std::size_t(node)].next;
      nx.insert(std::upper_bound(nx.begin(), nx.end(), std::make_pair(c, int32_t(-1))), {c, n});
    }
    node = n;
  }
  nodes_[std::size_t(node)].id = id;
  first_[static_cast<unsigned char>(content[0])] = true;
}

bool AddedTokenMatcher::find(std::string_view text, std::size_t from, Match* m) const {
  if (empty()) return false;
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (std::size_t i = from; i < text.size(); ++i) {
    if (!first_[s[i]]) continue;
    int32_t node = 0, best_id = -1;
    std::size_t best_end = 0;
    for (std::size_t j = i; j < text.size(); ++j) {
      node = child(node, s[j]);
      if (node < 0) break;
      if (nodes_[std::size_t(node)].id >= 0) {
        best_id = nodes_[std::size_t(node)].id;
        best_end = j + 1;
      }
    }
    if (best_id >= 0) {
      *m = Match{i, best_end, best_id};
      return true;
    }
  }
  return false;
}

}  // namespace dflash::text
