// `dflash generate`, `dflash eval` and `dflash prepare --regenerate` end to end on the real
// SmolLM2-135M-Instruct (fetched by scripts/fetch_smollm2.sh; skipped, saying so, without it):
// regenerate answers, train a drafter for a few steps, evaluate it; outputs with the drafter equal
// plain greedy decoding; mistakes give clear errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace fs = std::filesystem;
using namespace dflash;

namespace {

std::string smollm2() {
  const char* env = std::getenv("DFLASH_SMOLLM2_GGUF");
  const std::string p =
      env ? env : (test::source_dir() / ".cache" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
  return fs::exists(p) ? p : "";
}

std::string bin() { return test::dflash_binary().string() + " "; }

/// The output of dflash generate without its "generate: ..." report lines.
std::string answer(const std::string& out) {
  std::string r, line;
  std::istringstream in(out);
  while (std::getline(in, line))
    if (line.rfind("generate: ", 0) != 0) r += line + "\n";
  return r;
}

}  // namespace

TEST(EvalCli, RegenerateTrainEvalOnSmolLM2) {
  const std::string g = smollm2();
  if (g.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct GGUF not fetched (scripts/fetch_smollm2.sh needs PyPI access)";
  const fs::path tmp = fs::temp_directory_path() / ("dflash_eval_cli_" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  test::write_file(tmp / "train.jsonl",
                   "{\"question\": \"What is 2 + 2?\", \"answer\": \"4\"}\n"
                   "{\"question\": \"Name a color.\", \"answer\": \"blue\"}\n"
                   "{\"question\": \"Count to five.\", \"answer\": \"1 2 3 4 5\"}\n");
  test::write_file(tmp / "mt.jsonl", "{\"turns\": [\"What is 3 + 4?\", \"And times 2?\"]}\n");
  std::string log;
  // The target answers the prompts; the answers replace the data's.
  ASSERT_EQ(test::run_command(bin() + "prepare --regenerate --target " + g + " --data " + (tmp / "train.jsonl").string() +
                                  " --out " + (tmp / "prep").string() + " --max-new-tokens 24 --batch-size 2",
                              &log),
            0)
      << log;
  std::ifstream regen(tmp / "prep" / "regenerated.jsonl");
  std::string line;
  int records = 0;
  while (std::getline(regen, line)) {
    const auto j = nlohmann::json::parse(line);
    ASSERT_EQ(j["messages"].size(), 2u);
    EXPECT_EQ(j["messages"][1]["role"], "assistant");
    EXPECT_NE(j["messages"][1]["content"], records == 0 ? "4" : "blue");  // the target's words, not the data's
    ++records;
  }
  EXPECT_EQ(records, 3);
  EXPECT_FALSE(fs::exists(tmp / ("prep.regenerated-" + std::to_string(::getpid()))));
  ASSERT_EQ(test::run_command(bin() + "train --target " + g + " --data " + (tmp / "prep").string() + " --out " +
                                  (tmp / "run").string() + " --max-steps 2 --num-draft-layers 1 --block-size 4 --num-anchors 8",
                              &log),
            0)
      << log;
  // Eval of the run directory (its final/ drafter), GSM8K-like and multi-turn MT-bench-like prompts.
  ASSERT_EQ(test::run_command(bin() + "eval --target " + g + " --drafter " + (tmp / "run").string() + " --data " +
                                  (tmp / "train.jsonl").string() + " " + (tmp / "mt.jsonl").string() +
                                  " --limit 2 --max-new-tokens 12 --report " + (tmp / "rep.json").string() +
                                  " --record --results " + (tmp / "results").string(),
                              &log),
            0)
      << log;
  EXPECT_NE(log.find("acceptance length tau"), std::string::npos) << log;
  std::ifstream rep_file(tmp / "rep.json");
  const auto rep = nlohmann::json::parse(rep_file);
  EXPECT_EQ(rep["turns"], 4);  // 2 GSM8K-like prompts + 2 turns of the MT-bench-like one
  EXPECT_EQ(rep["identical_outputs"], 4) << log;
  EXPECT_GE(rep["tau"].get<double>(), 1.0);
  EXPECT_LE(rep["tau"].get<double>(), 4.0);
  EXPECT_EQ(rep["accept_length_histogram"].size(), 5u);
  ASSERT_EQ(rep["per_file"].size(), 2u);  // tau of each data file
  EXPECT_EQ(rep["per_file"][1]["turns"], 2);
  EXPECT_NE(log.find("mt.jsonl: tau"), std::string::npos) << log;
  EXPECT_GT(rep["verify_steps"].get<int64_t>(), 0);
  std::ifstream rec(tmp / "results" / "eval.jsonl");
  ASSERT_TRUE(std::getline(rec, line));
  EXPECT_EQ(nlohmann::json::parse(line)["metric"], "tau");
  // generate: the same answer with and without the drafter (greedy is lossless).
  std::string with, without;
  const std::string gen = bin() + "generate --target " + g + " --prompt 'Name three fruits.' --max-new-tokens 16";
  ASSERT_EQ(test::run_command(gen + " --drafter " + (tmp / "run").string(), &with), 0) << with;
  ASSERT_EQ(test::run_command(gen, &without), 0) << without;
  EXPECT_NE(with.find("acceptance length tau"), std::string::npos) << with;
  EXPECT_EQ(answer(with), answer(without));
  EXPECT_FALSE(answer(with).empty());
  // Mistakes: a drafter made for another target, no prompt in the data, a missing drafter.
  EXPECT_NE(test::run_command(bin() + "eval --target " + g + " --drafter " +
                                  (test::fixtures_dir() / "drafter" / "init").string() + " --data " +
                                  (tmp / "train.jsonl").string(),
                              &log),
            0);
  EXPECT_NE(log.find("does not fit the target"), std::string::npos) << log;
  test::write_file(tmp / "empty.jsonl", "{\"messages\": [{\"role\": \"assistant\", \"content\": \"hi\"}]}\n");
  EXPECT_NE(test::run_command(bin() + "eval --target " + g + " --drafter " + (tmp / "run").string() + " --data " +
                                  (tmp / "empty.jsonl").string(),
                              &log),
            0);
  EXPECT_NE(log.find("no prompt to run"), std::string::npos) << log;
  EXPECT_NE(test::run_command(bin() + "eval --target " + g + " --drafter " + (tmp / "nothing").string() + " --data " +
                                  (tmp / "train.jsonl").string(),
                              &log),
            0);
  EXPECT_NE(log.find("no such file or directory (--drafter)"), std::string::npos) << log;
  EXPECT_NE(test::run_command(bin() + "eval --target " + g + " --drafter " + (tmp / "prep").string() + " --data " +
                                  (tmp / "train.jsonl").string(),
                              &log),
            0);
  EXPECT_NE(log.find("not a drafter"), std::string::npos) << log;
  fs::remove_all(tmp);
}
