// A training sample: token ids with a loss mask on the assistant tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "text/chat_template.h"
#include "text/dataset.h"
#include "text/tokenizer.h"

namespace dflash {

/// ids [T] and loss_mask [T] (1 on tokens of assistant turns, their end-of-turn token included).
struct Sample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;
};

/// Renders `conv` with `family` (the whole conversation, no generation prompt), tokenizes it the way
/// transformers' apply_chat_template(tokenize=True) does (no extra special tokens), and sets the loss
/// mask on tokens that overlap an assistant segment. Sequences longer than `max_length` are cut
/// to it and `*truncated` is set. Throws std::invalid_argument for a bad conversation.
Sample build_sample(const Tokenizer& tok, ChatFamily family, const Conversation& conv, int64_t max_length,
                    bool* truncated);

}  // namespace dflash
