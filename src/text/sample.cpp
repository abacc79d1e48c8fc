#include "text/sample.h"

#include <algorithm>

namespace dflash {

Sample build_sample(const Tokenizer& tok, ChatFamily family, const Conversation& conv, int64_t max_length,
                    bool* truncated) {
  const std::vector<ChatSegment> segs = render_chat(family, conv.messages);
  std::string text;
  std::vector<std::pair<uint32_t, uint32_t>> assistant;  // byte ranges of assistant segments
  for (const ChatSegment& s : segs) {
    if (s.assistant) assistant.emplace_back(uint32_t(text.size()), uint32_t(text.size() + s.text.size()));
    text += s.text;
  }
  const std::vector<TokenSpan> spans = tok.encode_with_offsets(text, /*add_special_tokens=*/false);
  Sample out;
  out.ids.reserve(spans.size());
  out.loss_mask.reserve(spans.size());
  size_t a = 0;  // spans and segments are both in text order
  for (const TokenSpan& sp : spans) {
    while (a < assistant.size() && assistant[a].second <= sp.begin) ++a;
    out.ids.push_back(sp.id);
    // Loss on every token that overlaps an assistant segment (one that straddles the role header and
    // the content carries content bytes too).
    out.loss_mask.push_back(a < assistant.size() && assistant[a].first < sp.end ? 1 : 0);
  }
  *truncated = max_length > 0 && int64_t(out.ids.size()) > max_length;
  if (*truncated) {
    out.ids.resize(size_t(max_length));
    out.loss_mask.resize(size_t(max_length));
  }
  return out;
}

}  // namespace dflash
