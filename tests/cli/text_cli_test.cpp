// dflash tokenize and dflash prepare on the real Qwen3 tokenizer and the real data files in ../shared.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "text/packed.h"
#include "test_util.h"

using namespace dflash;
namespace fs = std::filesystem;

namespace {
fs::path shared() { return test::source_dir() / ".." / "shared"; }
#define REQUIRE_SHARED()                                                                              \
  if (!fs::exists(shared() / "tokenizers" / "qwen3" / "tokenizer.json"))                              \
    GTEST_SKIP() << "../shared (Qwen3 tokenizer, data) is not beside the checkout at " << shared();

std::string run(const std::string& args, int* rc) {
  std::string out;
  *rc = test::run_command(test::dflash_binary().string() + " " + args, &out);
  return out;
}
std::string tok() { return (shared() / "tokenizers" / "qwen3").string(); }
}  // namespace

TEST(TextCli, TokenizeTextAndChat) {
  REQUIRE_SHARED();
  int rc;
  std::string out = run("tokenize --tokenizer " + tok() + " --text 'Hello, world'", &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out), nlohmann::json::parse("[9707, 11, 1879]"));
  test::TempDir d;
  test::write_file(d / "c.json", R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])");
  out = run("tokenize --tokenizer " + tok() + " --chat " + (d / "c.json").string(), &rc);
  ASSERT_EQ(rc, 0) << out;
  // <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n
  const auto ids = nlohmann::json::parse(out).get<std::vector<int>>();
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids[ids.size() - 2], 151645);
  out = run("tokenize --tokenizer " + tok(), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("--text"), std::string::npos) << out;
}

TEST(TextCli, PrepareRealDataWritesPackedFilesAndManifest) {
  REQUIRE_SHARED();
  test::TempDir d;
  const std::string out_dir = (d / "prep").string();
  int rc;
  const std::string out = run("prepare --tokenizer " + tok() + " --max-length 128 --data " +
                                  (shared() / "data" / "sharegpt_sample" / "dummy_conversation.json").string() + " " +
                                  (shared() / "data" / "mt_bench" / "question.jsonl").string() + " --out " + out_dir,
                              &rc);
  ASSERT_EQ(rc, 0) << out;
  PackedDataset p(out_dir);
  EXPECT_EQ(p.num_samples(), 500);  // every ShareGPT conversation; MT-bench is prompt-only
  const auto& m = p.manifest();
  EXPECT_EQ(m["chat_template"], "qwen3");
  EXPECT_EQ(m["num_skipped"], 80);
  EXPECT_EQ(m["skipped"][0]["line"], 1);
  EXPECT_NE(m["skipped"][0]["reason"].get<std::string>().find("prompt-only"), std::string::npos);
  EXPECT_EQ(m["sources"].size(), 2u);
  int64_t loss = 0, longest = 0;
  for (int64_t i = 0; i < p.num_samples(); ++i) {
    for (uint8_t x : p.loss_mask(i)) loss += x;
    longest = std::max<int64_t>(longest, int64_t(p.ids(i).size()));
  }
  EXPECT_EQ(loss, m["num_loss_tokens"].get<int64_t>());
  EXPECT_LE(longest, 128);
  EXPECT_GT(loss, 0);
  // An existing output is never overwritten silently.
  const std::string again = run("prepare --tokenizer " + tok() + " --data " +
                                    (shared() / "data" / "mt_bench" / "question.jsonl").string() + " --out " + out_dir,
                                &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(again.find("--overwrite"), std::string::npos) << again;
}

TEST(TextCli, StrictPrepareFailsWithFileLineAndLeavesNothing) {
  REQUIRE_SHARED();
  test::TempDir d;
  test::write_file(d / "bad.jsonl",
                   "{\"question\": \"1+1?\", \"answer\": \"2\"}\n{\"question\": \"2+2?\", \"answer\": \"\"}\n");
  const std::string out_dir = (d / "prep").string();
  int rc;
  std::string out = run("prepare --strict --tokenizer " + tok() + " --data " + (d / "bad.jsonl").string() +
                            " --out " + out_dir,
                        &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("bad.jsonl:2: empty assistant turn"), std::string::npos) << out;
  for (const auto& e : fs::directory_iterator(d.path())) EXPECT_EQ(e.path().filename(), "bad.jsonl") << e.path();
  // Without --strict the bad record is skipped and reported.
  out = run("prepare --tokenizer " + tok() + " --data " + (d / "bad.jsonl").string() + " --out " + out_dir, &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("bad.jsonl:2: empty assistant turn"), std::string::npos) << out;
  EXPECT_EQ(PackedDataset(out_dir).num_samples(), 1);
}

TEST(TextCli, TokenizeChatEqualsApplyChatTemplateIds) {
  REQUIRE_SHARED();
  std::ifstream f(test::fixtures_dir() / "chat" / "qwen3_ids.json");
  const auto g = nlohmann::json::parse(f);
  test::TempDir d;
  int checked = 0;
  for (const auto& c : g["cases"]) {
    if (c["options"].value("add_generation_prompt", false) || c["options"].contains("enable_thinking")) continue;
    test::write_file(d / "c.json", c["messages"].dump());
    int rc;
    const std::string out = run("tokenize --tokenizer " + tok() + " --chat " + (d / "c.json").string(), &rc);
    ASSERT_EQ(rc, 0) << out;
    EXPECT_EQ(nlohmann::json::parse(out), c["ids"]) << c["name"];
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

TEST(TextCli, PrepareEdgeCases) {
  REQUIRE_SHARED();
  test::TempDir d;
  int rc;
  // reasoning_content reaches the sample (Qwen3 renders it inside <think>), a BOM before a JSON array
  // is skipped, and "DIR/" names DIR.
  test::write_file(d / "r.json",
                   "\xEF\xBB\xBF[{\"messages\": [{\"role\": \"user\", \"content\": \"2+2?\"}, {\"role\": \"assistant\", "
                   "\"content\": \"4\", \"reasoning_content\": \"two plus two is four\"}]}]");
  std::string out = run("prepare --tokenizer " + tok() + " --data " + (d / "r.json").string() + " --out " +
                            (d / "p").string() + "/",
                        &rc);
  ASSERT_EQ(rc, 0) << out;
  PackedDataset p((d / "p").string());
  ASSERT_EQ(p.num_samples(), 1);
  std::string ids_csv;
  for (int32_t id : p.ids(0)) ids_csv += (ids_csv.empty() ? "" : ",") + std::to_string(id);
  test::write_file(d / "c.json", R"([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "two plus two is four"}])");
  const std::string want = run("tokenize --tokenizer " + tok() + " --chat " + (d / "c.json").string(), &rc);
  EXPECT_EQ(nlohmann::json::parse(want), nlohmann::json::parse("[" + ids_csv + "]"));
  // --overwrite replaces only an earlier prepare output.
  fs::create_directory(d / "mine");
  test::write_file(d / "mine" / "keep.txt", "x");
  out = run("prepare --overwrite --tokenizer " + tok() + " --data " + (d / "r.json").string() + " --out " +
                (d / "mine").string(),
            &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("not the output of dflash prepare"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(d / "mine" / "keep.txt"));
  out = run("prepare --overwrite --tokenizer " + tok() + " --data " + (d / "r.json").string() + " --out " +
                (d / "p").string(),
            &rc);
  EXPECT_EQ(rc, 0) << out;
  // A conversation the template refuses is skipped with file:line, and no sample at all is an error.
  test::write_file(d / "t.jsonl",
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"system\", \"content\": \"late\"}, "
                   "{\"role\": \"assistant\", \"content\": \"b\"}]}\n");
  out = run("prepare --chat-template qwen3.5 --tokenizer " + tok() + " --data " + (d / "t.jsonl").string() + " --out " +
                (d / "q").string(),
            &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("no sample was produced"), std::string::npos) << out;
  EXPECT_NE(out.find("t.jsonl:1:"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(d / "q"));
}
