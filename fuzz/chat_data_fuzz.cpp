// libFuzzer target: the chat dataset readers (JSONL / JSON arrays of ShareGPT, messages,
// question-answer and prompt records), lenient mode: bad records are skipped and counted.
#include <exception>
#include <vector>

#include "fuzz_util.h"
#include "text/dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const char* name : {"data.jsonl", "data.json"}) {
    const std::string path = dflash::fuzz::write_input(data, size, name);
    try {
      std::vector<dflash::SkippedRecord> skipped;
      size_t n = 0;
      dflash::read_chat_file(path, false, [&](dflash::Conversation&& c) { n += c.messages.size(); }, skipped);
    } catch (const std::exception&) {
    }
  }
  return 0;
}
