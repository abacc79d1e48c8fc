// Tests for io/safetensors: round trips, sharded checkpoints, hostile files, atomic writes.
#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "test_util.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using test::TempDir;
using test::write_file;

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[std::size_t(i)] = char((v >> (8 * i)) & 0xff);
  return s;
}

/// A safetensors file from a header text and raw data bytes.
std::string st_bytes(const std::string& header, const std::string& data = "") {
  return le64(header.size()) + header + data;
}

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// Runs `fn`, expecting a std::runtime_error whose message contains every one of `needles`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no exception thrown";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << msg << "' lacks '" << n << "'";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  } catch (...) {
    ADD_FAILURE() << "non-std exception";
  }
}

std::vector<std::string> dir_entries(const fs::path& d) {
  std::vector<std::string> r;
  for (const auto& e : fs::directory_iterator(d)) r.push_back(e.path().filename().string());
  std::sort(r.begin(), r.end());
  return r;
}

template <class T>
SafetensorsEntry entry(const std::string& name, DType dt, std::vector<int64_t> shape, const std::vector<T>& v) {
  return {name, dt, std::move(shape), v.data()};
}

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(SafetensorsRoundTrip, AllDtypes) {
  TempDir td;
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0e8f, 1e-7f, 0.0f, -0.0f};
  const std::vector<float> src16 = {0.1f, -1.0f, 65504.0f, 3.140625f, -1e-5f, 2.5f};
  std::vector<uint16_t> f16, bf16;
  for (float x : src16) {
    f16.push_back(f32_to_f16(x));
    bf16.push_back(f32_to_bf16(x));
  }
  const std::vector<int64_t> i64 = {-5, 0, int64_t(1) << 40, 7};
  const std::vector<int32_t> i32 = {-2147483647, 0, 123456, -1};
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "x\"y"}};
  const auto path = (td / "rt.safetensors").string();
  write_safetensors(path,
                    {entry("f32", DType::F32, {2, 3}, f32), entry("f16", DType::F16, {6}, f16),
                     entry("bf16", DType::BF16, {3, 2}, bf16), entry("i64", DType::I64, {2, 2}, i64),
                     entry("i32", DType::I32, {4}, i32)},
                    meta);

  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 5u);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.path(), path);
  ASSERT_NE(f.find("bf16"), nullptr);
  EXPECT_EQ(f.find("nope"), nullptr);
  EXPECT_EQ(f.find("bf16")->dtype, DType::BF16);
  EXPECT_EQ(f.find("bf16")->storage, "BF16");
  EXPECT_EQ(f.find("bf16")->shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(f.find("bf16")->file, path);
  EXPECT_EQ(f.nbytes("f32"), 24u);
  EXPECT_EQ(std::memcmp(f.data("f32"), f32.data(), 24), 0);
  EXPECT_EQ(std::memcmp(f.data("f16"), f16.data(), 12), 0);
  EXPECT_EQ(std::memcmp(f.data("bf16"), bf16.data(), 12), 0);
  EXPECT_EQ(std::memcmp(f.data("i64"), i64.data(), 32), 0);
  EXPECT_EQ(std::memcmp(f.data("i32"), i32.data(), 16), 0);
  expect_error([&] { (void)f.data("nope"); }, {"rt.safetensors", "'nope'"});
  expect_error([&] { (void)f.nbytes("nope"); }, {"rt.safetensors", "'nope'"});

  auto ck = SafetensorsCheckpoint::open(path);
  EXPECT_EQ(ck->names(), (std::vector<std::string>{"bf16", "f16", "f32", "i32", "i64"}));
  EXPECT_EQ(ck->origin(), path);
  const Tensor tf = ck->load_f32("f32");
  EXPECT_EQ(tf.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(tf.data, f32);
  const Tensor th = ck->load_f32("f16");
  const Tensor tb = ck->load_f32("bf16");
  for (std::size_t i = 0; i < src16.size(); ++i) {
    EXPECT_EQ(th.data[i], f16_to_f32(f32_to_f16(src16[i])));
    EXPECT_NEAR(th.data[i], src16[i], std::fabs(src16[i]) * 1e-3 + 1e-7);
    EXPECT_EQ(tb.data[i], bf16_to_f32(f32_to_bf16(src16[i])));
    EXPECT_NEAR(tb.data[i], src16[i], std::fabs(src16[i]) * 1e-2);
  }
  const Tensor t64 = ck->load_f32("i64");
  EXPECT_EQ(t64.data, (std::vector<float>{-5.0f, 0.0f, 1099511627776.0f, 7.0f}));
  const Tensor t32 = ck->load_f32("i32");
  EXPECT_EQ(t32.data, (std::vector<float>{-2147483647.0f, 0.0f, 123456.0f, -1.0f}));
  EXPECT_EQ(ck->info("i32").dtype, DType::I32);
  EXPECT_TRUE(ck->has("i64"));
  EXPECT_FALSE(ck->has("zzz"));
  expect_error([&] { (void)ck->load_f32("zzz"); }, {"rt.safetensors", "'zzz'"});
  expect_error([&] { (void)ck->info("zzz"); }, {"rt.safetensors", "'zzz'"});
}

TEST(SafetensorsRoundTrip, LayoutPaddedAndContiguousInEntryOrder) {
  TempDir td;
  const std::vector<float> a(3, 1.0f), b(5, 2.0f);
  const std::vector<uint16_t> c(1, 0x3c00);
  const auto path = td / "layout.safetensors";
  write_safetensors(path.string(), {entry("zeta", DType::F32, {3}, a), entry("alpha", DType::F16, {1}, c),
                                    entry("mid", DType::F32, {5}, b)});
  const std::string bytes = read_all(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[std::size_t(i)]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 12 + 2 + 20);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.find_first_not_of(' ', header.find_last_of('}') + 1), std::string::npos);
  const auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["zeta"]["data_offsets"], nlohmann::json({0, 12}));
  EXPECT_EQ(j["alpha"]["data_offsets"], nlohmann::json({12, 14}));
  EXPECT_EQ(j["mid"]["data_offsets"], nlohmann::json({14, 34}));
  EXPECT_FALSE(j.contains("__metadata__"));
  SafetensorsFile f(path.string());
  ASSERT_EQ(f.tensors().size(), 3u);  // ordered by offset
  EXPECT_EQ(f.tensors()[0].name, "zeta");
  EXPECT_EQ(f.tensors()[1].name, "alpha");
  EXPECT_EQ(f.tensors()[2].name, "mid");
}

TEST(SafetensorsRoundTrip, TensorOverloadEmptyAndZeroSized) {
  TempDir td;
  Tensor a({2, 2});
  a.data = {1, 2, 3, 4};
  Tensor z({0, 3});
  Tensor s(std::vector<int64_t>{});
  s.data = {42.0f};
  const auto path = (td / "t.safetensors").string();
  write_safetensors(path, {{"a", &a}, {"z", &z}, {"s", &s}}, {{"k", "v"}});
  auto ck = SafetensorsCheckpoint::open(path);
  EXPECT_EQ(ck->load_f32("a").data, a.data);
  EXPECT_EQ(ck->load_f32("z").shape, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(ck->load_f32("z").data.empty());
  EXPECT_EQ(ck->load_f32("s").shape, std::vector<int64_t>{});
  EXPECT_EQ(ck->load_f32("s").data, std::vector<float>{42.0f});

  // No tensors at all: still a valid file.
  const auto empty = (td / "empty.safetensors").string();
  write_safetensors(empty, std::vector<SafetensorsEntry>{});
  SafetensorsFile fe(empty);
  EXPECT_TRUE(fe.tensors().empty());

  // Tensor whose shape disagrees with its data.
  Tensor bad;
  bad.shape = {3};
  bad.data = {1.0f};
  expect_error([&] { write_safetensors((td / "bad.safetensors").string(), {{"bad", &bad}}); },
               {"bad.safetensors", "'bad'"});
}

TEST(SafetensorsRoundTrip, HandWrittenHeaderWithUnalignedDataAndZeroSizedTensor) {
  TempDir td;
  // Header of odd length (data not aligned), a zero-sized tensor sitting inside another's range,
  // a gap and trailing padding in the header.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("e":{"dtype":"BF16","shape":[0,1099511627776,1099511627776],"data_offsets":[4,4]},)"
      R"("b":{"dtype":"I16","shape":[1],"data_offsets":[10,12]}}   )";
  std::string data(12, '\0');
  const float av[2] = {3.5f, -1.0f};
  std::memcpy(data.data(), av, 8);
  const int16_t bv = -300;
  std::memcpy(data.data() + 10, &bv, 2);
  const auto path = td / "hand.safetensors";
  write_file(path, st_bytes(header, data));
  auto ck = SafetensorsCheckpoint::open(path.string());
  EXPECT_EQ(ck->load_f32("a").data, (std::vector<float>{3.5f, -1.0f}));
  EXPECT_EQ(ck->load_f32("b").data, (std::vector<float>{-300.0f}));
  EXPECT_TRUE(ck->load_f32("e").data.empty());
}

TEST(SafetensorsFileTest, MoveKeepsMapping) {
  TempDir td;
  const std::vector<float> v = {1, 2, 3};
  const auto path = (td / "m.safetensors").string();
  write_safetensors(path, {entry("v", DType::F32, {3}, v)});
  SafetensorsFile a(path);
  SafetensorsFile b(std::move(a));
  EXPECT_EQ(std::memcmp(b.data("v"), v.data(), 12), 0);
  SafetensorsFile c(path);
  c = std::move(b);
  EXPECT_EQ(std::memcmp(c.data("v"), v.data(), 12), 0);
  std::vector<SafetensorsFile> many;
  for (int i = 0; i < 10; ++i) many.emplace_back(path);
  for (const auto& f : many) EXPECT_EQ(std::memcmp(f.data("v"), v.data(), 12), 0);
}

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints

struct Shards {
  TempDir td;
  std::vector<float> a = {1, 2, 3, 4}, b = {5, 6}, c = {7, 8, 9};
  std::vector<uint16_t> d;
  Shards() {
    for (float x : {0.5f, -0.25f}) d.push_back(f32_to_bf16(x));
    write_safetensors((td / "model-00001-of-00002.safetensors").string(),
                      {entry("layers.0.a", DType::F32, {2, 2}, a), entry("layers.0.b", DType::F32, {2}, b)});
    write_safetensors((td / "model-00002-of-00002.safetensors").string(),
                      {entry("layers.1.c", DType::F32, {3}, c), entry("layers.1.d", DType::BF16, {2}, d)});
  }
  void index(const nlohmann::json& weight_map) {
    write_file(td / "model.safetensors.index.json",
               nlohmann::json{{"metadata", {{"total_size", 44}}}, {"weight_map", weight_map}}.dump());
  }
  nlohmann::json good_map() const {
    return {{"layers.0.a", "model-00001-of-00002.safetensors"},
            {"layers.0.b", "model-00001-of-00002.safetensors"},
            {"layers.1.c", "model-00002-of-00002.safetensors"},
            {"layers.1.d", "model-00002-of-00002.safetensors"}};
  }
};

TEST(SafetensorsCheckpointTest, ShardedLoadsAllTensors) {
  Shards s;
  s.index(s.good_map());
  for (const std::string& p : {s.td.path().string(), (s.td / "model.safetensors.index.json").string()}) {
    auto ck = SafetensorsCheckpoint::open(p);
    EXPECT_EQ(ck->names(), (std::vector<std::string>{"layers.0.a", "layers.0.b", "layers.1.c", "layers.1.d"}));
    EXPECT_EQ(ck->shards().size(), 2u);
    EXPECT_EQ(ck->load_f32("layers.0.a").data, s.a);
    EXPECT_EQ(ck->load_f32("layers.0.a").shape, (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(ck->load_f32("layers.0.b").data, s.b);
    EXPECT_EQ(ck->load_f32("layers.1.c").data, s.c);
    EXPECT_EQ(ck->load_f32("layers.1.d").data, (std::vector<float>{0.5f, -0.25f}));
    const TensorInfo ti = ck->info("layers.1.c");
    EXPECT_NE(ti.file.find("model-00002-of-00002.safetensors"), std::string::npos);
  }
}

TEST(SafetensorsCheckpointTest, DirectoryWithSingleFileAndConcurrentReads) {
  TempDir td;
  std::vector<float> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = float(i) * 0.5f;
  write_safetensors((td / "model.safetensors").string(), {entry("w", DType::F32, {10, 100}, v)});
  auto ck = SafetensorsCheckpoint::open(td.path().string());
  std::vector<std::thread> threads;
  std::vector<int> ok(8, 0);
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < 20; ++r) ok[std::size_t(t)] += ck->load_f32("w").data == v;
    });
  for (auto& th : threads) th.join();
  for (int n : ok) EXPECT_EQ(n, 20);
}

TEST(SafetensorsCheckpointTest, MissingPathsAndEmptyDirectory) {
  TempDir td;
  expect_error([&] { SafetensorsCheckpoint::open((td / "nothing_here").string()); }, {"nothing_here"});
  expect_error([&] { SafetensorsCheckpoint::open(td.path().string()); },
               {td.path().string(), "model.safetensors"});
  expect_error([&] { SafetensorsFile f(td.path().string()); }, {td.path().string(), "not a regular file"});
  expect_error([&] { SafetensorsFile f((td / "absent.safetensors").string()); }, {"absent.safetensors"});
}

TEST(SafetensorsCheckpointTest, IndexPointsToMissingShard) {
  Shards s;
  auto m = s.good_map();
  m["layers.1.c"] = "missing.safetensors";
  s.index(m);
  expect_error([&] { SafetensorsCheckpoint::open(s.td.path().string()); },
               {"model.safetensors.index.json", "missing.safetensors"});
}

TEST(SafetensorsCheckpointTest, IndexWithPathEscape) {
  Shards s;
  for (const std::string evil : {"../evil.safetensors", "sub/x.safetensors", "/etc/passwd", "..", ""}) {
    auto m = s.good_map();
    m["layers.0.a"] = evil;
    s.index(m);
    std::vector<std::string> needles = {"model.safetensors.index.json", "'layers.0.a'"};
    if (!evil.empty()) needles.push_back(evil);
    expect_error([&] { SafetensorsCheckpoint::open(s.td.path().string()); }, needles);
  }
}

TEST(SafetensorsCheckpointTest, DuplicateTensorAcrossShards) {
  Shards s;
  const std::vector<float> dup = {1};
  write_safetensors((s.td / "a.safetensors").string(), {entry("dup", DType::F32, {1}, dup)});
  write_safetensors((s.td / "b.safetensors").string(),
                    {entry("dup", DType::F32, {1}, dup), entry("other", DType::F32, {1}, dup)});
  s.index({{"dup", "a.safetensors"}, {"other", "b.safetensors"}});
  expect_error([&] { SafetensorsCheckpoint::open(s.td.path().string()); },
               {"'dup'", "a.safetensors", "b.safetensors"});
}

TEST(SafetensorsCheckpointTest, MappedTensorAbsentFromShard) {
  Shards s;
  auto m = s.good_map();
  m["ghost"] = "model-00001-of-00002.safetensors";
  s.index(m);
  expect_error([&] { SafetensorsCheckpoint::open(s.td.path().string()); },
               {"model.safetensors.index.json", "'ghost'", "model-00001-of-00002.safetensors"});
  // Mapped to the wrong shard: absent from the named one.
  m = s.good_map();
  m["layers.1.c"] = "model-00001-of-00002.safetensors";
  s.index(m);
  expect_error([&] { SafetensorsCheckpoint::open(s.td.path().string()); },
               {"model.safetensors.index.json", "'layers.1.c'"});
}

TEST(SafetensorsCheckpointTest, BadIndexFiles) {
  Shards s;
  const auto idx = s.td / "model.safetensors.index.json";
  for (const std::string& text :
       {std::string(""), std::string("{nope"), std::string("[]"), std::string("{}"),
        std::string(R"({"weight_map": []})"), std::string(R"({"weight_map": {}})"),
        std::string(R"({"weight_map": {"layers.0.a": 3}})"),
        std::string(1000, '[') + std::string(1000, ']')}) {
    write_file(idx, text);
    expect_error([&] { SafetensorsCheckpoint::open(s.td.path().string()); }, {"model.safetensors.index.json"});
  }
}

TEST(SafetensorsCheckpointTest, CorruptShardIsNamed) {
  Shards s;
  s.index(s.good_map());
  write_file(s.td / "model-00002-of-00002.safetensors", "garbage");
  expect_error([&] { SafetensorsCheckpoint::open(s.td.path().string()); }, {"model-00002-of-00002.safetensors"});
}

// ---------------------------------------------------------------------------------------------
// Hostile single files

class SafetensorsHostile : public ::testing::Test {
 protected:
  TempDir td;
  /// Writes `bytes` as bad.safetensors and expects both the file reader and the checkpoint to
  /// throw a runtime_error naming the file and every one of `needles`.
  void expect_bad(const std::string& bytes, std::vector<std::string> needles = {}) {
    const auto path = td / "bad.safetensors";
    write_file(path, bytes);
    needles.push_back("bad.safetensors");
    expect_error([&] { SafetensorsFile f(path.string()); }, needles);
    expect_error([&] { SafetensorsCheckpoint::open(path.string()); }, needles);
  }
  static std::string one(const std::string& fields) { return R"({"w":{)" + fields + "}}"; }
};

TEST_F(SafetensorsHostile, EmptyFile) { expect_bad(""); }
TEST_F(SafetensorsHostile, SevenByteFile) { expect_bad(std::string(7, '\0')); }
TEST_F(SafetensorsHostile, HugeHeaderLength) {
  expect_bad(le64(uint64_t(1) << 63) + "{}");
  expect_bad(le64(~uint64_t(0)) + "{}");
  expect_bad(le64((100ull << 20) + 1) + "{}", {"exceeds"});
}
TEST_F(SafetensorsHostile, HeaderLengthPastEof) {
  expect_bad(le64(100) + "{}", {"past the end"});
  expect_bad(le64(3) + "{}");
}
TEST_F(SafetensorsHostile, NonJsonHeader) {
  expect_bad(st_bytes("{not json"), {"JSON"});
  expect_bad(st_bytes(""), {"JSON"});
  expect_bad(st_bytes(std::string("{}\0\0\0\0", 6)), {"JSON"});
  expect_bad(st_bytes("{\"w\xff\":{}}"), {"JSON"});  // invalid UTF-8
}
TEST_F(SafetensorsHostile, JsonArrayInsteadOfObject) {
  expect_bad(st_bytes("[1, 2]"), {"not a JSON object"});
  expect_bad(st_bytes("\"str\""), {"not a JSON object"});
}
TEST_F(SafetensorsHostile, DeeplyNested) {
  expect_bad(st_bytes(std::string(100000, '[') + std::string(100000, ']')), {"nested"});
  expect_bad(st_bytes(R"({"w":{"shape":[[1]]}})"), {"'w'", "nested"});
}
TEST_F(SafetensorsHostile, EntryNotObject) { expect_bad(st_bytes(R"({"w":[1,2]})"), {"'w'"}); }
TEST_F(SafetensorsHostile, EmptyTensorName) {
  expect_bad(st_bytes(R"({"":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})", "abcd"), {"empty name"});
}
TEST_F(SafetensorsHostile, MissingDtype) {
  expect_bad(st_bytes(one(R"("shape":[1],"data_offsets":[0,4])"), "abcd"), {"'w'", "dtype"});
}
TEST_F(SafetensorsHostile, DtypeNotString) {
  expect_bad(st_bytes(one(R"("dtype":7,"shape":[1],"data_offsets":[0,4])"), "abcd"), {"'w'", "dtype"});
}
TEST_F(SafetensorsHostile, UnknownDtype) {
  expect_bad(st_bytes(one(R"("dtype":"Q9","shape":[1],"data_offsets":[0,4])"), "abcd"), {"'w'", "Q9"});
}
TEST_F(SafetensorsHostile, MissingShapeOrOffsets) {
  expect_bad(st_bytes(one(R"("dtype":"F32","data_offsets":[0,4])"), "abcd"), {"'w'", "shape"});
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[1])"), "abcd"), {"'w'", "data_offsets"});
}
TEST_F(SafetensorsHostile, NegativeShape) {
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[-1,4],"data_offsets":[0,4])"), "abcd"), {"'w'", "negative"});
}
TEST_F(SafetensorsHostile, NonIntegerShape) {
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[1.0],"data_offsets":[0,4])"), "abcd"), {"'w'", "shape"});
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":["1"],"data_offsets":[0,4])"), "abcd"), {"'w'", "shape"});
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":1,"data_offsets":[0,4])"), "abcd"), {"'w'", "shape"});
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4])"), "abcd"),
             {"'w'", "too large"});
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[1e300],"data_offsets":[0,4])"), "abcd"), {"'w'"});
}
TEST_F(SafetensorsHostile, ShapeRankTooLarge) {
  std::string dims = "1";
  for (int i = 0; i < 100; ++i) dims += ",1";
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[)" + dims + R"(],"data_offsets":[0,4])"), "abcd"), {"'w'"});
}
TEST_F(SafetensorsHostile, OffsetsEndPastData) {
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[100],"data_offsets":[0,400])"), std::string(16, 'x')),
             {"'w'", "[0, 400]"});
}
TEST_F(SafetensorsHostile, OffsetsBeginAfterEnd) {
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[1],"data_offsets":[8,4])"), std::string(16, 'x')),
             {"'w'", "begin > end"});
}
TEST_F(SafetensorsHostile, MalformedOffsets) {
  for (const std::string off : {"[0]", "[0,4,8]", "[-4,0]", "[0,4.0]", "\"0,4\"", "{}", "[0,18446744073709551616]"})
    expect_bad(st_bytes(one(R"("dtype":"F32","shape":[1],"data_offsets":)" + off), "abcd"), {"'w'"});
}
TEST_F(SafetensorsHostile, SizeMismatchWithShape) {
  expect_bad(st_bytes(R"({"layers.0.w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,100]}})", std::string(100, 'x')),
             {"'layers.0.w'", "data_offsets [0, 100] do not match shape [3, 4] x F32 = 48 bytes"});
}
TEST_F(SafetensorsHostile, OverlappingTensors) {
  expect_bad(st_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                      R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                      std::string(24, 'x')),
             {"'a'", "'b'", "overlap"});
  // Identical ranges, and a small tensor nested inside a big one after a third tensor.
  expect_bad(st_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                      R"("b":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}})",
                      std::string(16, 'x')),
             {"'a'", "'b'", "overlap"});
  expect_bad(st_bytes(R"({"big":{"dtype":"U8","shape":[32],"data_offsets":[0,32]},)"
                      R"("mid":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},)"
                      R"("late":{"dtype":"U8","shape":[4],"data_offsets":[20,24]}})",
                      std::string(32, 'x')),
             {"'big'", "overlap"});
}
TEST_F(SafetensorsHostile, ShapeProductOverflow) {
  expect_bad(st_bytes(one(R"("dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,4])"), "abcd"),
             {"'w'", "overflow"});
  // Product fits in 64 bits but times the dtype size does not.
  expect_bad(st_bytes(one(R"("dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8])"), std::string(8, 'x')),
             {"'w'", "overflow"});
}
TEST_F(SafetensorsHostile, DuplicateTensorName) {
  expect_bad(st_bytes(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                      R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                      "ab"),
             {"'w'", "twice"});
}
TEST_F(SafetensorsHostile, MetadataNotStrings) {
  expect_bad(st_bytes(R"({"__metadata__":{"k":1}})"), {"__metadata__", "'k'"});
  expect_bad(st_bytes(R"({"__metadata__":{"ok":"x","k":{"a":"b"}}})"), {"__metadata__", "'k'"});
  expect_bad(st_bytes(R"({"__metadata__":["x"]})"), {"__metadata__"});
}
TEST_F(SafetensorsHostile, ControlCharactersInNameAreEscaped) {
  const auto path = td / "bad.safetensors";
  write_file(path, st_bytes(R"({"a\nb\u0000":{"dtype":"Q9","shape":[],"data_offsets":[0,0]}})"));
  try {
    SafetensorsFile f(path.string());
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'a\\x0ab\\x00'"), std::string::npos) << msg;
  }
}

// Random corruption of a valid file: every outcome is either a clean load or a runtime_error.
TEST_F(SafetensorsHostile, RandomCorruptionNeverCrashes) {
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> b(5, 0x3c00);
  const std::vector<int64_t> c = {1, -1};
  const auto good = td / "good.safetensors";
  write_safetensors(good.string(), {entry("a", DType::F32, {2, 3}, a), entry("b", DType::BF16, {5}, b),
                                    entry("c", DType::I64, {2}, c)},
                    {{"format", "pt"}});
  const std::string orig = read_all(good);
  std::mt19937 rng(1234);
  const std::string alphabet = "{}[]\",:-0123456789e.FIBU \\";
  const auto path = td / "fuzz.safetensors";
  int loaded = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string s = orig;
    const int kind = int(rng() % 4);
    if (kind == 0) {
      s.resize(rng() % s.size());
    } else {
      const int edits = 1 + int(rng() % 4);
      for (int e = 0; e < edits; ++e) {
        // Mostly hit the length prefix and header, where the structure lives.
        const std::size_t limit = (rng() % 4 == 0) ? s.size() : std::min<std::size_t>(s.size(), 8 + 200);
        const std::size_t pos = rng() % limit;
        if (kind == 1) s[pos] = char(rng() & 0xff);
        else if (kind == 2) s[pos] = alphabet[rng() % alphabet.size()];
        else s.insert(pos, 1, alphabet[rng() % alphabet.size()]);
      }
    }
    write_file(path, s);
    try {
      auto ck = SafetensorsCheckpoint::open(path.string());
      for (const auto& n : ck->names()) {
        const Tensor t = ck->load_f32(n);
        uint64_t numel = 1;
        for (auto d : t.shape) numel *= uint64_t(d);
        if (!t.data.empty()) {
          ASSERT_EQ(uint64_t(t.data.size()), numel);
        }
      }
      ++loaded;
    } catch (const std::runtime_error& e) {
      ASSERT_NE(std::string(e.what()).find("fuzz.safetensors"), std::string::npos) << e.what();
      ++rejected;
    }
  }
  EXPECT_GT(loaded, 0);
  EXPECT_GT(rejected, 0);
}

// ---------------------------------------------------------------------------------------------
// Writing

TEST(SafetensorsWrite, NonexistentDirectoryThrowsAndLeavesNothing) {
  TempDir td;
  const std::vector<float> v = {1, 2};
  const auto path = (td / "no_such_dir" / "x.safetensors").string();
  expect_error([&] { write_safetensors(path, {entry("v", DType::F32, {2}, v)}); }, {path});
  EXPECT_FALSE(fs::exists(td / "no_such_dir"));
  EXPECT_TRUE(dir_entries(td.path()).empty());
}

TEST(SafetensorsWrite, FailedRenameRemovesTempFile) {
  TempDir td;
  const std::vector<float> v = {1, 2};
  fs::create_directory(td / "target.safetensors");
  fs::create_directory(td / "target.safetensors" / "child");  // non-empty: rename cannot replace it
  const auto path = (td / "target.safetensors").string();
  expect_error([&] { write_safetensors(path, {entry("v", DType::F32, {2}, v)}); }, {path});
  EXPECT_EQ(dir_entries(td.path()), std::vector<std::string>{"target.safetensors"});
}

TEST(SafetensorsWrite, SuccessLeavesNoTempAndOverwritesAtomically) {
  TempDir td;
  const std::vector<float> v1 = {1, 2}, v2 = {3, 4, 5};
  const auto path = (td / "out.safetensors").string();
  write_safetensors(path, {entry("v", DType::F32, {2}, v1)});
  SafetensorsFile old_view(path);  // mapping of the old file stays valid after the rename
  write_safetensors(path, {entry("v", DType::F32, {3}, v2)});
  EXPECT_EQ(dir_entries(td.path()), std::vector<std::string>{"out.safetensors"});
  for (const auto& name : dir_entries(td.path())) EXPECT_EQ(name.find(".tmp."), std::string::npos);
  EXPECT_EQ(std::memcmp(old_view.data("v"), v1.data(), 8), 0);
  auto ck = SafetensorsCheckpoint::open(path);
  EXPECT_EQ(ck->load_f32("v").data, v2);
}

TEST(SafetensorsWrite, InvalidEntriesThrowAndWriteNothing) {
  TempDir td;
  const std::vector<float> v = {1, 2};
  const auto path = (td / "w.safetensors").string();
  expect_error([&] { write_safetensors(path, {entry("", DType::F32, {2}, v)}); }, {"w.safetensors"});
  expect_error([&] { write_safetensors(path, {entry("a", DType::F32, {2}, v), entry("a", DType::F32, {2}, v)}); },
               {"w.safetensors", "'a'"});
  expect_error([&] { write_safetensors(path, {entry("__metadata__", DType::F32, {2}, v)}); },
               {"w.safetensors", "__metadata__"});
  expect_error([&] { write_safetensors(path, {entry("neg", DType::F32, {-2}, v)}); }, {"w.safetensors", "'neg'"});
  expect_error([&] { write_safetensors(path, {SafetensorsEntry{"null", DType::F32, {2}, nullptr}}); },
               {"w.safetensors", "'null'"});
  expect_error(
      [&] { write_safetensors(path, {entry("huge", DType::F32, {int64_t(1) << 40, int64_t(1) << 40}, v)}); },
      {"w.safetensors", "'huge'"});
  expect_error([&] { write_safetensors(path, {{"t", static_cast<const Tensor*>(nullptr)}}); }, {"w.safetensors", "'t'"});
  EXPECT_TRUE(dir_entries(td.path()).empty());
}

}  // namespace
}  // namespace dflash
