// Dataset readers, sample building and packed files.
#include <gtest/gtest.h>

#include <filesystem>

#include "text/dataset.h"
#include "text/packed.h"
#include "text/sample.h"
#include "test_util.h"

using namespace dflash;

namespace {

std::vector<Conversation> read_all(const std::string& path, std::vector<SkippedRecord>& skipped, bool strict = false) {
  std::vector<Conversation> out;
  read_chat_file(path, strict, [&](Conversation&& c) { out.push_back(std::move(c)); }, skipped);
  return out;
}

std::filesystem::path shared_data() { return test::source_dir() / ".." / "shared" / "data"; }

/// One token per byte (id = byte value); enough to test masks and packing without a real vocabulary.
class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view t, bool) const override {
    std::vector<int32_t> r;
    for (unsigned char ch : t) r.push_back(ch);
    return r;
  }
  std::vector<TokenSpan> encode_with_offsets(std::string_view t, bool) const override {
    std::vector<TokenSpan> r;
    for (uint32_t i = 0; i < t.size(); ++i) r.push_back({static_cast<unsigned char>(t[i]), i, i + 1});
    return r;
  }
  std::string decode(const std::vector<int32_t>& ids, bool) const override { return std::string(ids.begin(), ids.end()); }
  std::optional<int32_t> token_to_id(std::string_view) const override { return std::nullopt; }
  std::string id_to_token(int32_t id) const override { return std::string(1, char(id)); }
  int64_t vocab_size() const override { return 256; }
  bool is_special(int32_t) const override { return false; }
  const std::string& chat_template() const override { return empty_; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::optional<int32_t> eos_id() const override { return std::nullopt; }

 private:
  std::string empty_;
};

}  // namespace

TEST(Dataset, ReadsEveryRealLayout) {
  if (!std::filesystem::exists(shared_data())) GTEST_SKIP() << "../shared/data not present beside the checkout";
  std::vector<SkippedRecord> sk;
  auto gsm = read_all((shared_data() / "gsm8k" / "train.jsonl").string(), sk);
  EXPECT_EQ(gsm.size(), 7473u);
  ASSERT_EQ(gsm[0].messages.size(), 2u);
  EXPECT_EQ(gsm[0].messages[0].role, "user");
  EXPECT_EQ(gsm[0].messages[1].role, "assistant");
  EXPECT_FALSE(gsm[0].prompt_only);
  auto mt = read_all((shared_data() / "mt_bench" / "question.jsonl").string(), sk);
  EXPECT_EQ(mt.size(), 80u);
  EXPECT_EQ(mt[0].messages.size(), 2u);
  EXPECT_TRUE(mt[0].prompt_only);
  auto sg = read_all((shared_data() / "sharegpt_sample" / "dummy_conversation.json").string(), sk);
  EXPECT_EQ(sg.size(), 500u);
  EXPECT_EQ(sg[0].messages[1].role, "assistant");
  EXPECT_EQ(sg[0].line, 1);
  EXPECT_TRUE(sk.empty());
}

TEST(Dataset, BadRecordsAreSkippedWithFileLineAndReason) {
  test::TempDir d;
  const auto p = (d / "x.jsonl").string();
  test::write_file(p,
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n"
                   "{not json\n"
                   "\n"
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"\"}]}\n"
                   "{\"conversations\": [{\"from\": \"alien\", \"value\": \"x\"}]}\n"
                   "{\"text\": \"no known layout\"}\n"
                   "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}\n"
                   "[1, 2]\n");
  std::vector<SkippedRecord> sk;
  auto ok = read_all(p, sk);
  ASSERT_EQ(ok.size(), 1u);
  ASSERT_EQ(sk.size(), 6u);
  EXPECT_EQ(sk[0].line, 2);
  EXPECT_NE(sk[0].reason.find("invalid JSON"), std::string::npos);
  EXPECT_EQ(sk[1].line, 4);
  EXPECT_NE(sk[1].reason.find("empty assistant turn"), std::string::npos);
  EXPECT_NE(sk[2].reason.find("alien"), std::string::npos);
  EXPECT_NE(sk[3].reason.find("unknown record layout"), std::string::npos);
  EXPECT_NE(sk[4].reason.find("not a string"), std::string::npos);
  EXPECT_NE(sk[5].reason.find("not a JSON object"), std::string::npos);
  std::vector<SkippedRecord> sk2;
  try {
    read_all(p, sk2, /*strict=*/true);
    FAIL() << "strict mode must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("x.jsonl:2: invalid JSON"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_all((d / "missing.jsonl").string(), sk2), std::runtime_error);
  test::write_file(d / "arr.json", "[{\"prompt\": \"a\"}, ");
  EXPECT_THROW(read_all((d / "arr.json").string(), sk2), std::runtime_error);
}

TEST(Sample, LossMaskCoversAssistantContentAndEndOfTurn) {
  ByteTokenizer tok;
  Conversation c;
  c.messages = {{"system", "S", std::nullopt}, {"user", "U", std::nullopt}, {"assistant", "AB", std::nullopt}};
  bool truncated = true;
  const Sample s = build_sample(tok, ChatFamily::ChatML, c, 0, &truncated);
  EXPECT_FALSE(truncated);
  const std::string text(s.ids.begin(), s.ids.end());
  EXPECT_EQ(text, render_chat_text(ChatFamily::ChatML, c.messages));
  std::string masked;
  for (size_t i = 0; i < s.ids.size(); ++i)
    if (s.loss_mask[i]) masked += char(s.ids[i]);
  EXPECT_EQ(masked, "AB<|im_end|>");
  const Sample t = build_sample(tok, ChatFamily::ChatML, c, 10, &truncated);
  EXPECT_TRUE(truncated);
  EXPECT_EQ(t.ids.size(), 10u);
  EXPECT_EQ(t.loss_mask.size(), 10u);
}

TEST(Packed, RoundTripAndValidation) {
  test::TempDir d;
  const std::string dir = (d / "p").string();
  {
    PackedWriter w(dir);
    w.add({{1, 2, 3}, {0, 1, 1}});
    w.add({{}, {}});
    w.add({{7, 8}, {1, 0}});
    w.finish({{"note", "test"}});
    EXPECT_EQ(w.num_loss_tokens(), 3);
  }
  PackedDataset p(dir);
  ASSERT_EQ(p.num_samples(), 3);
  EXPECT_EQ(p.num_tokens(), 5);
  EXPECT_EQ(std::vector<int32_t>(p.ids(2).begin(), p.ids(2).end()), (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(std::vector<uint8_t>(p.loss_mask(0).begin(), p.loss_mask(0).end()), (std::vector<uint8_t>{0, 1, 1}));
  EXPECT_EQ(p.ids(1).size(), 0u);
  EXPECT_EQ(p.manifest()["note"], "test");
  EXPECT_THROW(p.ids(3), std::out_of_range);
  EXPECT_THROW(PackedWriter{dir}, std::runtime_error);  // never writes into an existing directory
  // A truncated data file is caught at open.
  std::filesystem::resize_file(std::filesystem::path(dir) / "tokens.i32", 8);
  try {
    PackedDataset bad(dir);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("tokens.i32"), std::string::npos) << e.what();
  }
}
