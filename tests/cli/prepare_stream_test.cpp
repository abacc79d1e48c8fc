// A data file larger than the memory a run may use: `dflash prepare` streams it (read record by
// record, JSONL or a JSON array, written sample by sample), so its peak memory does not grow with the file.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "test_util.h"

namespace fs = std::filesystem;
using namespace dflash;

namespace {
/// Peak resident memory (KiB) of the largest child process waited for so far.
long children_max_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_CHILDREN, &u);
  return u.ru_maxrss;
}
}  // namespace

TEST(PrepareStreaming, PeakMemoryDoesNotGrowWithTheDataFile) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "memory bound measured without sanitizers (ASan keeps freed memory in quarantine)";
#endif
  const char* env = std::getenv("DFLASH_SMOLLM2_GGUF");
  const std::string gguf =
      env ? env : (test::source_dir() / ".cache" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
  if (!fs::exists(gguf)) GTEST_SKIP() << "SmolLM2-135M-Instruct GGUF (its tokenizer) not fetched";
  const fs::path tmp = fs::temp_directory_path() / ("dflash_stream_" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  // 64 MB of GSM8K-shaped records, and the first 100 of them.
  std::mt19937 g(5);
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "12", "345", "and", "then"};
  int64_t bytes = 0, n = 0;
  {
    // The same records as JSONL and as one JSON array: both readers stream.
    std::ofstream big(tmp / "big.jsonl"), array(tmp / "big.json"), small(tmp / "small.jsonl");
    array << "[";
    while (bytes < (int64_t(64) << 20)) {
      std::string q, a;
      for (int i = 0; i < 60; ++i) q += std::string(words[g() % 12]) + " ";
      for (int i = 0; i < 250; ++i) a += std::string(words[g() % 12]) + " ";
      const std::string line = "{\"question\": \"" + q + "\", \"answer\": \"" + a + "\"}\n";
      big << line;
      array << (n ? "," : "") << line;
      if (n++ < 100) small << line;
      bytes += int64_t(line.size());
    }
    array << "]\n";
  }
  const std::string bin = test::dflash_binary().string() + " prepare --tokenizer " + gguf + " --data ";
  std::string log;
  ASSERT_EQ(test::run_command(bin + (tmp / "small.jsonl").string() + " --out " + (tmp / "s").string(), &log), 0) << log;
  const long small_kb = children_max_rss_kb();
  ASSERT_EQ(test::run_command(bin + (tmp / "big.jsonl").string() + " --out " + (tmp / "b").string(), &log), 0) << log;
  EXPECT_NE(log.find(std::to_string(n) + " samples"), std::string::npos) << log;
  ASSERT_EQ(test::run_command(bin + (tmp / "big.json").string() + " --out " + (tmp / "a").string(), &log), 0) << log;
  EXPECT_NE(log.find(std::to_string(n) + " samples"), std::string::npos) << log;
  const long both_kb = children_max_rss_kb();  // max(small run, big runs)
  std::printf("[prepare] peak RSS: 100 records %ld KiB, %lld records (%lld MiB) at most %ld KiB\n", small_kb,
              (long long)n, (long long)(bytes >> 20), both_kb);
  EXPECT_LT(both_kb - small_kb, (bytes >> 10) / 4) << "a big run held a large part of the file in memory";
  fs::remove_all(tmp);
}
