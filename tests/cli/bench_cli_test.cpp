// `dflash bench` from the command line: the tiny pipeline preset runs where a GPU is visible and says
// plainly why not elsewhere; the CPU benches honour --no-record.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"
#ifdef DFLASH_HAVE_CUDA
#include "gpu/runtime.h"
#endif

using namespace dflash;

namespace {
std::string run_dflash(const std::string& args, int* rc) {
  std::string out;
  *rc = test::run_command(test::dflash_binary().string() + " " + args, &out);
  return out;
}
}  // namespace

TEST(BenchCli, PipelineTinyRunsOnAGpuOrSaysWhyNot) {
  int rc;
  const std::string out = run_dflash("bench pipeline --preset tiny --steps 2 --warmup 1 --no-record", &rc);
#ifdef DFLASH_HAVE_CUDA
  if (!cuda::has_device()) {
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find("bench pipeline: no usable CUDA device"), std::string::npos) << out;
    return;
  }
  ASSERT_EQ(rc, 0) << out;
  std::istringstream lines(out);
  std::string line;
  std::vector<std::string> metrics;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["bench"], "pipeline");
    EXPECT_GT(j["value"].get<double>(), 0) << line;
    metrics.push_back(j["metric"]);
  }
  EXPECT_EQ(metrics, (std::vector<std::string>{"samples_per_s", "tokens_per_s", "peak_gb"}));
#else
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("this build has no CUDA backend"), std::string::npos) << out;
#endif
}

// The CPU benches print their record and, with --no-record, append nothing: the results directory
// is not even created; without the flag the record is appended there.
TEST(BenchCli, CpuBenchesHonourNoRecord) {
  test::TempDir tmp;
  const std::string results = (tmp / "results").string();
  const std::string model = (test::fixtures_dir() / "qwen3").string();
  int rc;
  std::string out = run_dflash("bench target-forward --model " + model + " --tokens 8 --repeat 1 --no-record --results " +
                                   results,
                               &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"bench\":\"target-forward\""), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(tmp / "results")) << out;
  out = run_dflash("bench target-forward --model " + model + " --tokens 8 --repeat 1 --results " + results, &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(std::filesystem::exists(tmp / "results" / "target-forward.jsonl")) << out;
}
