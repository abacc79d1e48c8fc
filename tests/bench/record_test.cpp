// Benchmark records: the JSONL line carries every required field and appends, never overwrites.
#include <gtest/gtest.h>

#include <fstream>

#include "bench/record.h"
#include "test_util.h"

using namespace dflash;

TEST(BenchRecord, AppendsJsonlWithAllFields) {
  test::TempDir d;
  BenchRecord r;
  r.bench = "unit";
  r.preset = "p";
  r.metric = "tokens_per_s";
  r.value = 12.5;
  r.unit = "tokens/s";
  append_bench_record(d.path().string(), r);
  r.value = 13.0;
  append_bench_record(d.path().string(), r);
  std::ifstream f(d / "unit.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    for (const char* k : {"bench", "preset", "metric", "value", "unit", "commit", "device", "date"})
      EXPECT_TRUE(j.contains(k)) << k;
    EXPECT_EQ(j["value"].get<double>(), n == 0 ? 12.5 : 13.0);
    EXPECT_EQ(j["date"].get<std::string>().size(), 20u);  // 2026-11-29T22:56:07Z
    ++n;
  }
  EXPECT_EQ(n, 2);
  EXPECT_TRUE(std::filesystem::exists(d / "unit.md"));
  r.metric.clear();
  EXPECT_THROW(append_bench_record(d.path().string(), r), std::invalid_argument);
}

TEST(BenchRecord, WithoutRecordingIsCompletedAndWrittenNowhere) {
  test::TempDir d;
  BenchRecord r;
  r.bench = "unit";
  r.metric = "ms";
  const BenchRecord c = complete_bench_record(r);
  EXPECT_FALSE(c.commit.empty());
  EXPECT_FALSE(c.device.empty());
  EXPECT_EQ(c.date.size(), 20u);
  BenchRecord given = r;
  given.commit = "abc1234";  // what the caller set stays
  EXPECT_EQ(complete_bench_record(given).commit, "abc1234");
  testing::internal::CaptureStdout();
  print_bench_record(d.path().string(), r, false);  // --no-record
  const auto j = nlohmann::json::parse(testing::internal::GetCapturedStdout());
  EXPECT_FALSE(j["commit"].get<std::string>().empty());
  EXPECT_FALSE(j["device"].get<std::string>().empty());
  EXPECT_FALSE(std::filesystem::exists(d / "unit.jsonl"));
}
