// The byte-level BPE tokenizer against Hugging Face goldens (tests/fixtures/tokenizer/*.json, made by
// scripts/tokenizer_goldens.py): exact ids, decodes and offsets for the real Qwen3 tokenizer
// (../shared/tokenizers/qwen3 beside the source tree) and for SmolLM2's GGUF as transformers converts
// it (env DFLASH_SMOLLM2_GGUF). Plus toy tokenizers for the BPE rules, malformed files, threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "io/gguf.h"
#include "text/tokenizer.h"
#include "text/tokenizer_regex.h"
#include "text/tokenizer_unicode.h"
#include "test_util.h"

using namespace dflash;
using nlohmann::json;

namespace {

std::filesystem::path qwen3_dir() { return test::source_dir().parent_path() / "shared" / "tokenizers" / "qwen3"; }
std::filesystem::path gsm8k_path() { return test::source_dir().parent_path() / "shared" / "data" / "gsm8k" / "train.jsonl"; }
std::string smollm2_gguf() {
  const char* p = std::getenv("DFLASH_SMOLLM2_GGUF");
  return p ? p : "";
}

#define REQUIRE_QWEN3()                                                                      \
  if (!std::filesystem::exists(qwen3_dir() / "tokenizer.json")) {                            \
    GTEST_SKIP() << "Qwen3 tokenizer not found at " << qwen3_dir().string()                  \
                 << "/tokenizer.json (it lives in the shared directory beside the source tree, not in git)"; \
  }

#define REQUIRE_SMOLLM2()                                                                                 \
  if (smollm2_gguf().empty()) {                                                                           \
    GTEST_SKIP() << "SmolLM2 GGUF not available (DFLASH_SMOLLM2_GGUF unset; scripts/test.sh fetches it)"; \
  }                                                                                                       \
  if (!std::filesystem::exists(test::fixtures_dir() / "tokenizer" / "smollm2.json")) {                    \
    GTEST_SKIP() << "tests/fixtures/tokenizer/smollm2.json missing: run scripts/tokenizer_goldens.py "     \
                    "--only smollm2 --gguf <SmolLM2 GGUF> where torch + transformers are installed";      \
  }

// Tokenizers are loaded once per process (Qwen3's tokenizer.json is 11 MB).
const Tokenizer& qwen3() {
  static std::unique_ptr<Tokenizer> t = Tokenizer::load(qwen3_dir().string());
  return *t;
}
const Tokenizer& smollm2() {
  static std::unique_ptr<Tokenizer> t = Tokenizer::load(smollm2_gguf());
  return *t;
}

json golden(const char* name) {
  std::ifstream f(test::fixtures_dir() / "tokenizer" / name);
  return json::parse(f);
}

std::string show(const std::string& s) { return json(s).dump(); }

std::vector<std::string> gsm8k_texts(std::size_t max) {
  std::vector<std::string> out;
  std::ifstream f(gsm8k_path());
  std::string line;
  while (out.size() < max && std::getline(f, line)) {
    if (line.empty()) continue;
    const json r = json::parse(line);
    out.push_back(r["question"].get<std::string>() + "\n" + r["answer"].get<std::string>());
  }
  return out;
}

// Ids, ids with special tokens, decodes and (where the golden has them) byte offsets.
void check_goldens(const Tokenizer& tok, const json& g, int min_cases) {
  int n = 0, bad_ids = 0, bad_special = 0, bad_decode = 0, bad_offsets = 0, with_offsets = 0;
  for (const auto& c : g["cases"]) {
    ++n;
    const std::string text = c["text"].get<std::string>();
    const auto want = c["ids"].get<std::vector<int32_t>>();
    const auto got = tok.encode(text, false);
    if (got != want) {
      ++bad_ids;
      ADD_FAILURE() << "ids differ for " << show(text) << "\n  got  " << json(got).dump() << "\n  want " << json(want).dump();
    }
    if (tok.encode(text, true) != c["ids_special"].get<std::vector<int32_t>>()) {
      ++bad_special;
      ADD_FAILURE() << "ids (add_special_tokens) differ for " << show(text);
    }
    const std::string dec = tok.decode(want, false), dec_skip = tok.decode(want, true);
    if (dec != c["decode"].get<std::string>() || dec_skip != c["decode_skip"].get<std::string>()) {
      ++bad_decode;
      ADD_FAILURE() << "decode differs for " << show(text) << ": " << show(dec) << " / " << show(dec_skip);
    }
    if (c.contains("offsets")) {
      ++with_offsets;
      const auto spans = tok.encode_with_offsets(text, false);
      std::vector<std::array<uint32_t, 2>> offs;
      std::vector<int32_t> ids;
      for (const auto& s : spans) {
        offs.push_back({s.begin, s.end});
        ids.push_back(s.id);
      }
      if (offs != c["offsets"].get<std::vector<std::array<uint32_t, 2>>>() || ids != want) {
        ++bad_offsets;
        ADD_FAILURE() << "offsets differ for " << show(text) << "\n  got  " << json(offs).dump() << "\n  want "
                      << c["offsets"].dump();
      }
    }
  }
  EXPECT_GE(n, min_cases);
  EXPECT_GE(with_offsets, 10);
  std::cout << "[ goldens  ] " << g["tokenizer"].get<std::string>() << ": " << n << " strings, ids " << (n - bad_ids) << "/" << n
            << ", ids+special " << (n - bad_special) << "/" << n << ", decode " << (n - bad_decode) << "/" << n
            << ", offsets " << (with_offsets - bad_offsets) << "/" << with_offsets << "\n";
}

// Spans are in order, cover the whole text without gaps and only overlap inside one character.
void check_spans_tile(const Tokenizer& tok, const std::string& text) {
  const auto spans = tok.encode_with_offsets(text, false);
  if (text.empty()) {
    EXPECT_TRUE(spans.empty());
    return;
  }
  ASSERT_FALSE(spans.empty()) << show(text);
  EXPECT_EQ(spans.front().begin, 0u) << show(text);
  EXPECT_EQ(spans.back().end, text.size()) << show(text);
  for (std::size_t i = 0; i < spans.size(); ++i) {
    EXPECT_LT(spans[i].begin, spans[i].end) << show(text) << " token " << i;
    EXPECT_LE(spans[i].end, text.size());
    if (i == 0) continue;
    EXPECT_GE(spans[i].begin, spans[i - 1].begin) << show(text) << " token " << i;
    EXPECT_GE(spans[i].end, spans[i - 1].end) << show(text) << " token " << i;
    EXPECT_LE(spans[i].begin, spans[i - 1].end) << "gap before token " << i << " of " << show(text);
  }
}

// ---- A toy byte-level tokenizer.json -------------------------------------------------------------

// Vocabulary: the 256 byte-level characters (ids 0..255 in byte order), then `extra` tokens.
json toy_tokenizer(const std::vector<std::string>& extra, const json& merges) {
  const auto& alpha = text::byte_level_alphabet();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[alpha.byte_char[b]] = b;
  int id = 256;
  for (const auto& t : extra) vocab[t] = id++;
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", json::array({json{{"id", id}, {"content", "<|end|>"}, {"single_word", false}, {"lstrip", false},
                                                 {"rstrip", false}, {"normalized", false}, {"special", true}},
                                            json{{"id", id + 1}, {"content", "<|end|>x"}, {"single_word", false}, {"lstrip", false},
                                                 {"rstrip", false}, {"normalized", false}, {"special", false}}})},
              {"normalizer", {{"type", "NFC"}}},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}}},
              {"post_processor", nullptr},
              {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}}},
              {"model",
               {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                {"vocab", vocab}, {"merges", merges}}}};
}

std::unique_ptr<Tokenizer> load_json(const test::TempDir& d, const json& j, const std::string& name = "tokenizer.json") {
  test::write_file(d / name, j.dump());
  return Tokenizer::from_tokenizer_json((d / name).string());
}

std::string load_error(const test::TempDir& d, const std::string& content) {
  test::write_file(d / "tokenizer.json", content);
  try {
    Tokenizer::from_tokenizer_json((d / "tokenizer.json").string());
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

// ---- Real tokenizers against the goldens ---------------------------------------------------------

TEST(TokenizerQwen3, GoldenIdsDecodesAndOffsets) {
  REQUIRE_QWEN3();
  check_goldens(qwen3(), golden("qwen3.json"), 60);
}

TEST(TokenizerQwen3, MetadataSpecialTokensAndTemplate) {
  REQUIRE_QWEN3();
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.token_to_id("<think>"), 151667);
  EXPECT_EQ(t.token_to_id("Hello"), 9707);
  EXPECT_EQ(t.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(t.id_to_token(9707), "Hello");
  EXPECT_EQ(t.id_to_token(151645), "<|im_end|>");
  EXPECT_TRUE(t.is_special(151643));
  EXPECT_FALSE(t.is_special(151667));  // <think> is an added token but not special
  EXPECT_FALSE(t.is_special(9707));
  EXPECT_EQ(t.bos_id(), std::nullopt);  // bos_token is null in tokenizer_config.json
  EXPECT_EQ(t.eos_id(), 151645);
  EXPECT_NE(t.chat_template().find("<|im_start|>"), std::string::npos);
  // Special tokens inside text; skip_special_tokens drops special ones only.
  const std::string s = "<|im_start|>user\nhi<think>x</think><|im_end|>";
  const auto ids = t.encode(s);
  ASSERT_GE(ids.size(), 6u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 151667), ids.end());
  EXPECT_EQ(t.decode(ids), s);
  EXPECT_EQ(t.decode(ids, true), "user\nhi<think>x</think>");
  const auto spans = t.encode_with_offsets(s);
  EXPECT_EQ(spans.front().begin, 0u);
  EXPECT_EQ(spans.front().end, 12u);
}

TEST(TokenizerQwen3, OutOfRangeIdsThrow) {
  REQUIRE_QWEN3();
  const Tokenizer& t = qwen3();
  EXPECT_THROW(t.decode({1, -1}), std::out_of_range);
  EXPECT_THROW(t.decode({int32_t(t.vocab_size())}), std::out_of_range);
  EXPECT_THROW(t.id_to_token(int32_t(t.vocab_size())), std::out_of_range);
  EXPECT_THROW(t.id_to_token(-5), std::out_of_range);
  EXPECT_NO_THROW(t.decode({int32_t(t.vocab_size() - 1)}));
}

TEST(TokenizerQwen3, InvalidUtf8IsRejected) {
  REQUIRE_QWEN3();
  EXPECT_THROW(qwen3().encode(std::string("ab\xC3(", 4)), std::invalid_argument);
  EXPECT_THROW(qwen3().encode(std::string("\xED\xA0\x80", 3)), std::invalid_argument);  // a surrogate
  // Decoding half of a character gives U+FFFD, as tokenizers' lossy decode does.
  const auto ids = qwen3().encode("\xF0\x9D\x94\x98");  // U+1D518: two byte-level tokens
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(qwen3().decode({ids[0]}), "\xEF\xBF\xBD");
}

TEST(TokenizerQwen3, RoundTripAndSpansTileGoldensAndGsm8k) {
  REQUIRE_QWEN3();
  const Tokenizer& t = qwen3();
  const json g = golden("qwen3.json");
  for (const auto& c : g["cases"]) {
    const std::string s = c["text"].get<std::string>();
    std::string n;
    const bool nfc_changes = text::nfc(s, n);
    EXPECT_EQ(t.decode(t.encode(s)), nfc_changes ? n : s) << show(s);
    check_spans_tile(t, s);
  }
  if (!std::filesystem::exists(gsm8k_path())) GTEST_SKIP() << "GSM8K not found at " << gsm8k_path().string();
  for (const auto& s : gsm8k_texts(500)) {
    ASSERT_EQ(t.decode(t.encode(s)), s);
    check_spans_tile(t, s);
  }
}

TEST(TokenizerQwen3, LongInputsAndHostilePieces) {
  REQUIRE_QWEN3();
  const Tokenizer& t = qwen3();
  // One 200 kB word, a 100 kB whitespace run and a long run of one emoji: heap merging, JIT stack.
  for (const std::string& s : {std::string(200000, 'x'), std::string(100000, ' ') + "a", std::string(50000, '\n'),
                               [] {
                                 std::string e;
                                 for (int i = 0; i < 20000; ++i) e += "\xF0\x9F\x98\x80";
                                 return e;
                               }()}) {
    const auto ids = t.encode(s);
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(t.decode(ids), s);
  }
}

TEST(TokenizerQwen3, ThreadsGiveTheSameIds) {
  REQUIRE_QWEN3();
  if (!std::filesystem::exists(gsm8k_path())) GTEST_SKIP() << "GSM8K not found at " << gsm8k_path().string();
  const auto texts = gsm8k_texts(2000);
  // A fresh tokenizer: its word cache starts cold, so the threads fill it concurrently.
  const auto tok = Tokenizer::load(qwen3_dir().string());
  std::vector<std::vector<int32_t>> want;
  for (const auto& s : texts) want.push_back(qwen3().encode(s));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> th;
  for (int k = 0; k < 4; ++k)
    th.emplace_back([&, k] {
      for (std::size_t i = 0; i < texts.size(); ++i) {
        const std::size_t j = (i + std::size_t(k) * 497) % texts.size();  // different orders
        if (tok->encode(texts[j]) != want[j]) ++mismatches[std::size_t(k)];
      }
    });
  for (auto& x : th) x.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(mismatches[std::size_t(k)], 0) << "thread " << k;
}

TEST(TokenizerSmolLM2, GoldenIdsDecodesAndOffsetsFromGguf) {
  REQUIRE_SMOLLM2();
  check_goldens(smollm2(), golden("smollm2.json"), 60);
}

TEST(TokenizerSmolLM2, MetadataAndRoundTrip) {
  REQUIRE_SMOLLM2();
  const Tokenizer& t = smollm2();
  EXPECT_EQ(t.vocab_size(), 49152);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_TRUE(t.is_special(0));
  EXPECT_TRUE(t.is_special(16));
  EXPECT_FALSE(t.is_special(17));
  EXPECT_NE(t.chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(t.encode("a", true), t.encode("a", false));  // transformers adds no BOS for this GGUF
  const json g = golden("smollm2.json");
  for (const auto& c : g["cases"]) {
    const std::string s = c["text"].get<std::string>();
    if (c["decode"].get<std::string>() == s) {
      EXPECT_EQ(t.decode(t.encode(s)), s) << show(s);
    }
    check_spans_tile(t, s);
  }
}

// ---- BPE rules on toy tokenizers -----------------------------------------------------------------

TEST(TokenizerBpe, MergesAsStringsOrPairsAndRankOrder) {
  test::TempDir d;
  // "ab" merges before "bc": "abc" -> ab + c; with the ranks swapped -> a + bc.
  const auto t1 = load_json(d, toy_tokenizer({"ab", "bc", "abc"}, json::array({"a b", "b c", "ab c"})), "t1.json");
  const auto t2 = load_json(d, toy_tokenizer({"ab", "bc", "abc"}, json::array({json::array({"a", "b"}), json::array({"b", "c"}),
                                                                                json::array({"ab", "c"})})),
                            "t2.json");
  const auto t3 = load_json(d, toy_tokenizer({"ab", "bc", "abc"}, json::array({"b c", "a b"})), "t3.json");
  EXPECT_EQ(t1->encode("abc"), (std::vector<int32_t>{258}));
  EXPECT_EQ(t2->encode("abc"), (std::vector<int32_t>{258}));
  EXPECT_EQ(t3->encode("abc"), (std::vector<int32_t>{'a', 257}));
  // Leftmost first among equal ranks: "aaa" with "a a" -> aa + a.
  const auto t4 = load_json(d, toy_tokenizer({"aa"}, json::array({"a a"})), "t4.json");
  EXPECT_EQ(t4->encode("aaa"), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(t4->encode("aaaa"), (std::vector<int32_t>{256, 256}));
  // The long-word (heap) path agrees with the short-word path.
  std::vector<int32_t> want;
  for (int i = 0; i < 150; ++i) want.push_back(256);
  want.push_back('a');
  EXPECT_EQ(t4->encode(std::string(301, 'a')), want);
  // Byte-level: a space is 'Ġ' (id 32 here); GPT-2 split keeps " a" together.
  EXPECT_EQ(t4->encode("aa aa"), (std::vector<int32_t>{256, ' ', 256}));
  EXPECT_EQ(t4->decode({256, ' ', 256}), "aa aa");
}

TEST(TokenizerBpe, AddedTokensLeftmostLongest) {
  test::TempDir d;
  const auto t = load_json(d, toy_tokenizer({}, json::array()));
  EXPECT_EQ(t->vocab_size(), 258);
  EXPECT_EQ(t->encode("<|end|>"), (std::vector<int32_t>{256}));
  EXPECT_EQ(t->encode("<|end|>x"), (std::vector<int32_t>{257}));  // the longer match wins
  EXPECT_EQ(t->encode("a<|end|>y"), (std::vector<int32_t>{'a', 256, 'y'}));
  EXPECT_EQ(t->encode("<|end|"), (std::vector<int32_t>{'<', '|', 'e', 'n', 'd', '|'}));
  EXPECT_EQ(t->decode({'a', 256, 'y'}, true), "ay");
  EXPECT_EQ(t->decode({'a', 257, 'y'}, true), "a<|end|>xy");  // not special: kept
}

TEST(TokenizerBpe, UnknownBytesByteFallbackAndFusedUnk) {
  test::TempDir d;
  const auto& alpha = text::byte_level_alphabet();
  json j = toy_tokenizer({"<unk>", "<0x43>", "<0x84>"}, json::array());
  // Remove the byte-level characters of bytes 0x01, 0x02 and 0x04 (U+0101, U+0102, U+0104).
  for (int b : {1, 2, 4}) j["model"]["vocab"].erase(alpha.byte_char[b]);
  j["model"]["unk_token"] = "<unk>";
  j["model"]["fuse_unk"] = true;
  const auto fused = load_json(d, j, "fused.json");
  EXPECT_EQ(fused->encode(std::string("a\x01\x02z", 4)), (std::vector<int32_t>{'a', 256, 'z'}));
  j["model"]["fuse_unk"] = false;
  const auto unfused = load_json(d, j, "unfused.json");
  EXPECT_EQ(unfused->encode(std::string("a\x01\x02z", 4)), (std::vector<int32_t>{'a', 256, 256, 'z'}));
  // byte_fallback looks up the UTF-8 bytes of the byte-level character: U+0104 is C4 84; without
  // a <0xC4> token byte 0x04 stays unknown, with it the character falls back on <0xC4> <0x84>.
  j["model"]["byte_fallback"] = true;
  EXPECT_EQ(load_json(d, j, "no_c4.json")->encode(std::string("\x04", 1)), (std::vector<int32_t>{256}));
  j["model"]["vocab"]["<0xC4>"] = 261;
  j["added_tokens"][0]["id"] = 262;
  j["added_tokens"][1]["id"] = 263;
  const auto fb = load_json(d, j, "fallback.json");
  EXPECT_EQ(fb->encode(std::string("\x04", 1)), (std::vector<int32_t>{261, 258}));
  // A pending unknown token goes out after fallback tokens that follow it (tokenizers 0.23.3 gives
  // these ids too; here fuse_unk is false, so 0x01 and 0x02 are two unknown tokens).
  EXPECT_EQ(fb->encode(std::string("\x01\x04\x02" "a", 4)), (std::vector<int32_t>{261, 258, 256, 256, 'a'}));
  EXPECT_EQ(fb->decode({'a', 256, 'z'}), "a<unk>z");
}

TEST(TokenizerBpe, IgnoreMergesAndTemplatePostProcessor) {
  test::TempDir d;
  json j = toy_tokenizer({"ab", "abc"}, json::array({"a b"}));
  EXPECT_EQ(load_json(d, j, "a.json")->encode("abc"), (std::vector<int32_t>{256, 'c'}));
  j["model"]["ignore_merges"] = true;
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({json{{"SpecialToken", {{"id", "<|end|>"}, {"type_id", 0}}}},
                                                 json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                         {"pair", json::array()},
                         {"special_tokens", {{"<|end|>", {{"id", "<|end|>"}, {"ids", json::array({258})}, {"tokens", json::array({"<|end|>"})}}}}}};
  j["added_tokens"][0]["id"] = 258;
  j["added_tokens"][1]["id"] = 259;
  const auto t = load_json(d, j, "b.json");
  EXPECT_EQ(t->encode("abc"), (std::vector<int32_t>{257}));
  EXPECT_EQ(t->encode("abc", true), (std::vector<int32_t>{258, 257}));
  const auto spans = t->encode_with_offsets("abc", true);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].begin, 0u);
  EXPECT_EQ(spans[0].end, 0u);
  EXPECT_EQ(spans[1].end, 3u);
}

TEST(TokenizerBpe, DecoderChainAsTokenizers) {
  // Expected texts from tokenizers 0.23.3 with the same vocabulary and decoders.
  test::TempDir d;
  json j = toy_tokenizer({"<0x41>", "<0xC3>", "<0xA9>", "\xC4\xA0" "a", "\xE2\x96\x81" "b", "<0xFF>"}, json::array());
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", json::array({json{{"type", "ByteFallback"}}, json{{"type", "Fuse"}},
                                            json{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
                                            json{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}},
                                            json{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  const auto t = load_json(d, j);
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(t->decode({256, 257, 258}), "A" + fffd);  // bytes -> "Aé", then ByteLevel maps 'é' to byte E9
  EXPECT_EQ(t->decode({256, 261}), fffd + fffd);     // invalid bytes: one U+FFFD each
  EXPECT_EQ(t->decode({259}), "a");                  // "Ġa" -> " a" -> Strip
  EXPECT_EQ(t->decode({260, 'a'}), "ba");            // "▁ba" -> " ba" (not byte-level: kept) -> Strip
  EXPECT_EQ(t->decode({259, 260}), "\xC4\xA0" "a b");  // a fused text with ' ' is left as it is
  EXPECT_EQ(t->decode({' ', ' ', 'a'}), " a");
}

TEST(TokenizerBpe, NfcOffsetsCoverTheOriginalCharacters) {
  test::TempDir d;
  const auto t = load_json(d, toy_tokenizer({}, json::array()));
  // "e" + COMBINING ACUTE (3 bytes in) -> "é" (2 bytes, 2 byte-level tokens): both cover bytes 0..3.
  const auto spans = t->encode_with_offsets("e\xCC\x81!");
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].begin, 0u);
  EXPECT_EQ(spans[0].end, 3u);
  EXPECT_EQ(spans[1].end, 3u);
  EXPECT_EQ(spans[2].begin, 3u);
  EXPECT_EQ(spans[2].end, 4u);
  EXPECT_EQ(t->decode(t->encode("e\xCC\x81")), "\xC3\xA9");
}

TEST(TokenizerRegex, WhiteSpaceIsOnigurumas) {
  // PCRE2's \s also matches U+180E (MONGOLIAN VOWEL SEPARATOR), Oniguruma's does not.
  const text::SplitRegex re(R"(\s+|[^\s]+)", false);
  const std::string s = "a\xE1\xA0\x8E" "b\xC2\x85" "c";  // a U+180E b U+0085 c
  std::size_t b = 0, e = 0;
  ASSERT_TRUE(text::has_onig_divergent_chars(s));
  ASSERT_TRUE(re.find(s.data(), s.size(), 0, &b, &e, true));
  EXPECT_EQ(e, 5u);  // "a U+180E b" is one non-space run
  ASSERT_TRUE(re.find(s.data(), s.size(), e, &b, &e, true));
  EXPECT_EQ(e - b, 2u);  // U+0085 is white space
  ASSERT_TRUE(re.find(s.data(), s.size(), 0, &b, &e, false));
  EXPECT_EQ(e, 1u);  // PCRE2's own \s takes U+180E
  EXPECT_FALSE(text::has_onig_divergent_chars("plain text \xE4\xB8\xAD\xF0\x9F\x98\x80"));
  EXPECT_TRUE(text::has_onig_divergent_chars("\xEA\x9F\x9C"));      // U+A7DC, a Unicode 16 letter
  EXPECT_TRUE(text::has_onig_divergent_chars("\xF0\x9E\x97\xB1"));  // U+1E5F1, a Unicode 16 digit
  EXPECT_THROW(text::onig_compatible_pattern(R"([\S])"), std::invalid_argument);
  EXPECT_EQ(text::onig_compatible_pattern(R"(\\s)"), R"(\\s)");
}

// ---- Malformed files -----------------------------------------------------------------------------

TEST(TokenizerErrors, MalformedTokenizerJsonNamesFileAndComponent) {
  test::TempDir d;
  const std::string path = (d / "tokenizer.json").string();
  auto expect_error = [&](const std::string& content, const std::vector<std::string>& parts) {
    const std::string err = load_error(d, content);
    EXPECT_NE(err.find(path), std::string::npos) << err;
    for (const auto& p : parts) EXPECT_NE(err.find(p), std::string::npos) << "missing '" << p << "' in: " << err;
  };
  const json good = toy_tokenizer({"ab"}, json::array({"a b"}));
  EXPECT_NO_THROW(load_json(d, good));
  expect_error("{\"model\": ", {"not valid JSON"});
  expect_error("[1, 2]", {"not a JSON object"});
  json j = good;
  j.erase("model");
  expect_error(j.dump(), {"no \"model\""});
  j = good;
  j["model"]["type"] = "WordPiece";
  expect_error(j.dump(), {"model", "WordPiece", "BPE"});
  j = good;
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_error(j.dump(), {"pre_tokenizer", "Whitespace"});
  auto split = [](const std::string& regex, const std::string& behavior) {
    return json{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", behavior}, {"invert", false}};
  };
  j = good;
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({split("\\s+", "Removed")})}};
  expect_error(j.dump(), {"Split", "Removed"});
  j = good;
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({split("(a", "Isolated"), good["pre_tokenizer"]})}};
  expect_error(j.dump(), {"pre_tokenizer Split", "does not compile"});
  j = good;
  j["pre_tokenizer"] = nullptr;
  expect_error(j.dump(), {"ByteLevel"});
  j = good;
  j["normalizer"] = {{"type", "NFKC"}};
  expect_error(j.dump(), {"normalizer", "NFKC"});
  j = good;
  j["decoder"] = {{"type", "WordPiece"}};
  expect_error(j.dump(), {"decoder", "WordPiece"});
  j = good;
  j["post_processor"] = {{"type", "BertProcessing"}};
  expect_error(j.dump(), {"post_processor", "BertProcessing"});
  j = good;
  j["model"]["merges"] = json::array({"a zz"});
  expect_error(j.dump(), {"merge 1", "zz", "not in the vocabulary"});
  j = good;
  j["model"]["merges"] = json::array({"a b c"});
  expect_error(j.dump(), {"merge 1"});
  j = good;
  j["model"]["merges"] = json::array({"b a"});
  expect_error(j.dump(), {"merge 1", "'ba'", "not in the vocabulary"});
  j = good;
  j["model"]["unk_token"] = "<nope>";
  expect_error(j.dump(), {"unk_token", "<nope>"});
  j = good;
  j["model"]["dropout"] = 0.1;
  expect_error(j.dump(), {"dropout"});
  j = good;
  j["added_tokens"][0]["lstrip"] = true;
  expect_error(j.dump(), {"added token '<|end|>'", "lstrip"});
  j = good;
  j["model"]["vocab"]["dup"] = 5;
  expect_error(j.dump(), {"id 5"});
  j = good;
  j["model"]["vocab"]["huge"] = 2000000000;
  expect_error(j.dump(), {"id 2000000000 is too large"});
}

TEST(TokenizerErrors, LoadPathsAndGguf) {
  test::TempDir d;
  EXPECT_THROW(Tokenizer::load((d / "missing.json").string()), std::runtime_error);
  EXPECT_THROW(Tokenizer::load(d.path().string()), std::runtime_error);  // no tokenizer.json inside
  // A directory with tokenizer.json and tokenizer_config.json.
  load_json(d, toy_tokenizer({}, json::array()));
  test::write_file(d / "tokenizer_config.json",
                   json{{"chat_template", "{{ x }}"}, {"eos_token", {{"content", "<|end|>"}}}, {"bos_token", nullptr}}.dump());
  const auto t = Tokenizer::load(d.path().string());
  EXPECT_EQ(t->chat_template(), "{{ x }}");
  EXPECT_EQ(t->eos_id(), 256);
  EXPECT_EQ(t->bos_id(), std::nullopt);
}

// ---- The bench command ---------------------------------------------------------------------------

TEST(TokenizerBench, CommandRecordsTokensPerSecond) {
  REQUIRE_QWEN3();
  test::TempDir d;
  std::ofstream(d / "data.jsonl") << R"({"question": "What is 2+2?", "answer": "2+2 = <<2+2=4>>4\n#### 4"})" << "\n"
                                  << R"({"question": "Héllo wörld 😀", "answer": "#### 0"})" << "\n";
  std::string out;
  const std::string cmd = test::dflash_binary().string() + " bench tokenize --tokenizer " + qwen3_dir().string() +
                          " --data " + (d / "data.jsonl").string() + " --repeat 1 --results " + (d / "results").string();
  ASSERT_EQ(test::run_command(cmd, &out), 0) << out;
  std::ifstream f(d / "results" / "tokenize.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(f, line)) << out;
  const json rec = json::parse(line);
  EXPECT_EQ(rec["bench"], "tokenize");
  EXPECT_EQ(rec["metric"], "tokens_per_s");
  EXPECT_GT(rec["value"].get<double>(), 0.0);
  const std::string preset = rec["preset"].get<std::string>();  // <tokenizer>-<data dir>-<data file>-dflash
  EXPECT_EQ(preset.rfind("qwen3-", 0), 0u) << preset;
  EXPECT_TRUE(preset.size() > 12 && preset.substr(preset.size() - 12) == "-data-dflash") << preset;
  const std::string q = "What is 2+2?\n2+2 = <<2+2=4>>4\n#### 4", h = "Héllo wörld 😀\n#### 0";
  EXPECT_EQ(rec["extra"]["tokens"].get<int64_t>(), int64_t(qwen3().encode(q).size() + qwen3().encode(h).size()));
}

// Found by fuzz/tokenizer_json_fuzz: a pre-tokenizer regex whose Oniguruma translation fails
// ("\P{L}" inside a negated class) leaked the compiled PCRE2 pattern; now it is refused and freed
// (the AddressSanitizer pass of scripts/test.sh checks for the leak).
TEST(TokenizerErrors, UntranslatableRegexIsRefusedWithoutLeaking) {
  const auto path = test::source_dir() / "fuzz" / "regressions" / "tokenizer_json_fuzz" / "leak_on_untranslatable_regex.json";
  EXPECT_THROW((void)Tokenizer::from_tokenizer_json(path.string()), std::exception);
}
