// Tests of the GGUF reader (io/gguf.h): container parsing, metadata, dequantization of every
// supported ggml type against values computed here from the block definitions, the llama
// mapping (names, Q/K RoPE un-permutation, ModelSpec) and hostile files.
#include "io/gguf.h"
#include "models/gguf_llama.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <cstring>
#include <optional>
#include <set>

#include "test_util.h"

namespace dflash {
namespace {

using test::TempDir;
using test::write_file;

// ---------------------------------------------------------------------------------------------
// A small GGUF writer (little-endian host assumed, as the reader does).

template <class T>
void put(std::string& s, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  s.append(b, sizeof(T));
}
void put_str(std::string& s, const std::string& v) {
  put<uint64_t>(s, v.size());
  s += v;
}

enum VT : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kStr = 8,
  kArr = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

/// Encoded array value (without the outer value-type tag): elem type, count, payload.
std::string arr_payload(uint32_t elem_type, uint64_t count, const std::string& elems) {
  std::string s;
  put<uint32_t>(s, elem_type);
  put<uint64_t>(s, count);
  return s + elems;
}
template <class T>
std::string arr_of(uint32_t elem_type, const std::vector<T>& v) {
  std::string e;
  for (const T& x : v) put<T>(e, x);
  return arr_payload(elem_type, v.size(), e);
}
std::string arr_of_str(const std::vector<std::string>& v) {
  std::string e;
  for (const auto& x : v) put_str(e, x);
  return arr_payload(kStr, v.size(), e);
}

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> ne;  // GGUF order
  uint32_t type = 0;
  std::string data;
  std::optional<uint64_t> offset;  // written instead of the natural offset
};

class GGUFBuilder {
 public:
  uint32_t version = 3;
  uint64_t alignment = 32;  // layout alignment (set general.alignment to match when not 32)

  template <class T>
  GGUFBuilder& kv(const std::string& key, uint32_t type, T v) {
    std::string p;
    put<T>(p, v);
    return kv_raw(key, type, p);
  }
  GGUFBuilder& kv_str(const std::string& key, const std::string& v) {
    std::string p;
    put_str(p, v);
    return kv_raw(key, kStr, p);
  }
  GGUFBuilder& kv_arr(const std::string& key, const std::string& payload) {
    return kv_raw(key, kArr, payload);
  }
  GGUFBuilder& kv_raw(const std::string& key, uint32_t type, const std::string& payload) {
    put_str(kvs_, key);
    put<uint32_t>(kvs_, type);
    kvs_ += payload;
    ++n_kv_;
    return *this;
  }
  GGUFBuilder& tensor(TensorSpec t) {
    tensors_.push_back(std::move(t));
    return *this;
  }

  /// Header, kvs, tensor infos, padding, data (each tensor padded to the alignment except the
  /// last, so that the last tensor ends exactly at end of file).
  std::string build() const {
    std::string out = "GGUF";
    put<uint32_t>(out, version);
    put<uint64_t>(out, tensors_.size());
    put<uint64_t>(out, n_kv_);
    out += kvs_;
    uint64_t off = 0;
    std::vector<uint64_t> offs;
    for (const auto& t : tensors_) {
      offs.push_back(off);
      off = align(off + t.data.size());
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      put_str(out, t.name);
      put<uint32_t>(out, uint32_t(t.ne.size()));
      for (uint64_t n : t.ne) put<uint64_t>(out, n);
      put<uint32_t>(out, t.type);
      put<uint64_t>(out, t.offset.value_or(offs[i]));
    }
    out.resize(align(out.size()), '\0');
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      out += tensors_[i].data;
      if (i + 1 < tensors_.size()) out.resize(align(out.size()), '\0');
    }
    return out;
  }

 private:
  uint64_t align(uint64_t x) const { return (x + alignment - 1) / alignment * alignment; }
  std::string kvs_;
  uint64_t n_kv_ = 0;
  std::vector<TensorSpec> tensors_;
};

// ---------------------------------------------------------------------------------------------
// Block encoders. Scales are chosen as exact halves (f16 bit patterns written by hand), so all
// expected values below are exact and compared with ==.

constexpr uint16_t kH0_5 = 0x3800, kHm1_25 = 0xBD00, kH0_25 = 0x3400, kH2 = 0x4000,
                   kH0_125 = 0x3000, kH1 = 0x3C00, kHm2 = 0xC000, kH3 = 0x4200, kH65504 = 0x7BFF,
                   kHsub = 0x0001;  // 2^-24

/// Deterministic pseudo-random integers.
struct Lcg {
  uint64_t s;
  explicit Lcg(uint64_t seed) : s(seed) {}
  uint32_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(s >> 33);
  }
  int uniform(int lo, int hi) { return lo + int(next() % uint32_t(hi - lo + 1)); }
};

/// Q8_0 block: value[i] = d * q[i].
std::string q8_0_block(uint16_t d, const std::vector<int>& q) {
  std::string b;
  put<uint16_t>(b, d);
  for (int x : q) put<int8_t>(b, int8_t(x));
  return b;
}
/// Q4_0 / Q4_1 nibbles: element j in the low nibble of byte j, element j+16 in the high one.
std::string nibbles32(const std::vector<int>& q) {
  std::string b;
  for (int j = 0; j < 16; ++j) put<uint8_t>(b, uint8_t(q[j] | (q[j + 16] << 4)));
  return b;
}

/// Q4_K block with per-sub-block (32 values) 6-bit scales sc[8] and mins mn[8], 4-bit q[256].
/// Packing of the 12 scale bytes: byte j (j<4) = sc[j] | (sc[j+4] >> 4) << 6; byte 4+j =
/// mn[j] | (mn[j+4] >> 4) << 6; byte 8+j = (sc[j+4] & 15) | (mn[j+4] & 15) << 4.
/// Values: element e lives in 64-value chunk e/64; the first 32 of a chunk in the low nibbles of
/// its 32 qs bytes, the next 32 in the high nibbles.
std::string q4_k_block(uint16_t d, uint16_t dmin, const int* sc, const int* mn, const int* q) {
  std::string b;
  put<uint16_t>(b, d);
  put<uint16_t>(b, dmin);
  uint8_t s[12];
  for (int j = 0; j < 4; ++j) {
    s[j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = uint8_t(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = uint8_t((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
  b.append(reinterpret_cast<const char*>(s), 12);
  uint8_t qs[128] = {};
  for (int e = 0; e < 256; ++e) {
    const int chunk = e / 64, r = e % 64;
    if (r < 32) qs[chunk * 32 + r] |= uint8_t(q[e]);
    else qs[chunk * 32 + r - 32] |= uint8_t(q[e] << 4);
  }
  b.append(reinterpret_cast<const char*>(qs), 128);
  return b;
}

/// Q6_K block with int8 scales[16] (one per 16 values) and 6-bit q[256] (value = q - 32).
/// Element e: half h = e/128, k = (e%128)/32, l = e%32. Low 4 bits go to
/// ql[64h + 32(k&1) + l] (low nibble for k<2, high for k>=2); high 2 bits to bits 2k..2k+1 of
/// qh[32h + l].
std::string q6_k_block(uint16_t d, const int* scales, const int* q) {
  uint8_t ql[128] = {}, qh[64] = {};
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, k = (e % 128) / 32, l = e % 32;
    ql[64 * h + 32 * (k & 1) + l] |= uint8_t((q[e] & 15) << (k >= 2 ? 4 : 0));
    qh[32 * h + l] |= uint8_t((q[e] >> 4) << (2 * k));
  }
  std::string b(reinterpret_cast<const char*>(ql), 128);
  b.append(reinterpret_cast<const char*>(qh), 64);
  for (int i = 0; i < 16; ++i) put<int8_t>(b, int8_t(scales[i]));
  put<uint16_t>(b, d);
  return b;
}

float f16v(uint16_t h) {  // only the exact constants above
  switch (h) {
    case kH0_5: return 0.5f;
    case kHm1_25: return -1.25f;
    case kH0_25: return 0.25f;
    case kH2: return 2.0f;
    case kH0_125: return 0.125f;
    case kH1: return 1.0f;
    case kHm2: return -2.0f;
    case kH3: return 3.0f;
    case kH65504: return 65504.0f;
    case kHsub: return std::ldexp(1.0f, -24);
  }
  ADD_FAILURE() << "no constant for " << h;
  return 0;
}

/// Writes `bytes` into `dir` and opens it.
std::unique_ptr<GGUFFile> open_bytes(const TempDir& dir, const std::string& bytes,
                                     const std::string& name = "m.gguf") {
  write_file(dir / name, bytes);
  return std::make_unique<GGUFFile>((dir / name).string());
}

/// The runtime_error message of opening `bytes` ("" plus a test failure when it opens).
std::string open_error(const std::string& bytes) {
  TempDir dir;
  write_file(dir / "bad.gguf", bytes);
  try {
    GGUFFile f((dir / "bad.gguf").string());
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bad.gguf"), std::string::npos) << msg;
    return msg;
  }
  ADD_FAILURE() << "file opened without error";
  return "";
}

#define EXPECT_CONTAINS(hay, needle) \
  EXPECT_NE(std::string(hay).find(needle), std::string::npos) << "in: " << (hay)

TensorSpec f32_tensor(const std::string& name, std::vector<uint64_t> ne, const std::vector<float>& v) {
  TensorSpec t{name, std::move(ne), 0, {}, {}};
  for (float x : v) put<float>(t.data, x);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Container and metadata

GGUFBuilder all_types_builder() {
  GGUFBuilder b;
  b.kv<uint8_t>("t.u8", kU8, 200)
      .kv<int8_t>("t.i8", kI8, -100)
      .kv<uint16_t>("t.u16", kU16, 60000)
      .kv<int16_t>("t.i16", kI16, -30000)
      .kv<uint32_t>("t.u32", kU32, 4000000000u)
      .kv<int32_t>("t.i32", kI32, -2000000000)
      .kv<uint64_t>("t.u64", kU64, 18000000000000000000ull)
      .kv<int64_t>("t.i64", kI64, -9000000000000000000ll)
      .kv<float>("t.f32", kF32, 0.1f)
      .kv<float>("t.eps", kF32, 1e-5f)
      .kv<double>("t.f64", kF64, -2.5e300)
      .kv<uint8_t>("t.true", kBool, 1)
      .kv<uint8_t>("t.false", kBool, 0)
      .kv_str("t.str", "héllo, GGUF")
      .kv_str("t.empty_str", "")
      .kv_arr("t.arr_i32", arr_of<int32_t>(kI32, {1, -2, 3}))
      .kv_arr("t.arr_f32", arr_of<float>(kF32, {0.5f, -0.25f}))
      .kv_arr("t.arr_bool", arr_of<uint8_t>(kBool, {1, 0, 1}))
      .kv_arr("t.arr_str", arr_of_str({"a", "", "ccc"}))
      .kv_arr("t.arr_empty", arr_payload(kU64, 0, ""))
      .kv_arr("t.arr_nested",
              arr_payload(kArr, 2,
                          arr_of<int16_t>(kI16, {7, -8}) + arr_of_str({"x"})));
  return b;
}

TEST(GGUFMetadata, EveryValueTypeRoundTrips) {
  for (uint32_t version : {2u, 3u}) {
    GGUFBuilder b = all_types_builder();
    b.version = version;
    b.tensor(f32_tensor("a", {3}, {1, 2, 3}));
    TempDir dir;
    auto f = open_bytes(dir, b.build());
    EXPECT_EQ(f->version(), version);
    EXPECT_EQ(f->alignment(), 32u);
    EXPECT_EQ(f->data_offset() % 32, 0u);
    const auto& m = f->metadata();
    ASSERT_TRUE(m.is_object());
    EXPECT_EQ(m.size(), 21u);
    EXPECT_EQ(m["t.u8"].get<int>(), 200);
    EXPECT_EQ(m["t.i8"].get<int>(), -100);
    EXPECT_EQ(m["t.u16"].get<int>(), 60000);
    EXPECT_EQ(m["t.i16"].get<int>(), -30000);
    EXPECT_EQ(m["t.u32"].get<uint32_t>(), 4000000000u);
    EXPECT_EQ(m["t.i32"].get<int32_t>(), -2000000000);
    EXPECT_TRUE(m["t.u64"].is_number_unsigned());
    EXPECT_EQ(m["t.u64"].get<uint64_t>(), 18000000000000000000ull);
    EXPECT_EQ(m["t.i64"].get<int64_t>(), -9000000000000000000ll);
    EXPECT_TRUE(m["t.f32"].is_number_float());
    EXPECT_EQ(float(m["t.f32"].get<double>()), 0.1f);
    EXPECT_EQ(m["t.f32"].get<double>(), 0.1);  // shortest decimal of the float
    EXPECT_EQ(m["t.eps"].get<double>(), 1e-5);
    EXPECT_EQ(m["t.f64"].get<double>(), -2.5e300);
    EXPECT_EQ(m["t.true"], true);
    EXPECT_EQ(m["t.false"], false);
    EXPECT_EQ(m["t.str"], "héllo, GGUF");
    EXPECT_EQ(m["t.empty_str"], "");
    EXPECT_EQ(m["t.arr_i32"], nlohmann::json({1, -2, 3}));
    EXPECT_EQ(m["t.arr_f32"], nlohmann::json({0.5, -0.25}));
    EXPECT_EQ(m["t.arr_bool"], nlohmann::json({true, false, true}));
    EXPECT_EQ(m["t.arr_str"], nlohmann::json({"a", "", "ccc"}));
    EXPECT_EQ(m["t.arr_empty"], nlohmann::json::array());
    EXPECT_EQ(m["t.arr_nested"], nlohmann::json::parse(R"([[7, -8], ["x"]])"));

    EXPECT_EQ(f->metadata_type("t.u8"), GGUFValueType::UINT8);
    EXPECT_EQ(f->metadata_type("t.f32"), GGUFValueType::FLOAT32);
    EXPECT_EQ(f->metadata_type("t.true"), GGUFValueType::BOOL);
    EXPECT_EQ(f->metadata_type("t.arr_nested"), GGUFValueType::ARRAY);
    EXPECT_EQ(f->metadata_type("t.i64"), GGUFValueType::INT64);
    EXPECT_TRUE(f->has_key("t.str"));
    EXPECT_FALSE(f->has_key("nope"));
    EXPECT_THROW(f->metadata_type("nope"), std::runtime_error);
    EXPECT_EQ(f->architecture(), "");
  }
}

TEST(GGUFMetadata, TensorInfosAndAlignment) {
  GGUFBuilder b;
  b.alignment = 64;
  b.kv<uint32_t>("general.alignment", kU32, 64);
  b.tensor(f32_tensor("first", {5}, {1, 2, 3, 4, 5}));
  b.tensor(f32_tensor("second", {2, 3}, {1, 2, 3, 4, 5, 6}));
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  EXPECT_EQ(f->alignment(), 64u);
  EXPECT_EQ(f->data_offset() % 64, 0u);
  ASSERT_EQ(f->tensors().size(), 2u);
  const auto& t0 = f->tensors()[0];
  const auto& t1 = f->tensors()[1];
  EXPECT_EQ(t0.name, "first");
  EXPECT_EQ(t0.offset, 0u);
  EXPECT_EQ(t0.nbytes, 20u);
  EXPECT_EQ(t1.name, "second");
  EXPECT_EQ(t1.offset, 64u);
  EXPECT_EQ(t1.ne, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t1.shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(t1.numel, 6);
  EXPECT_EQ(t1.type_name(), "F32");
  EXPECT_EQ(f->find("second"), &t1);
  EXPECT_EQ(f->find("third"), nullptr);
  EXPECT_THROW(f->tensor("third"), std::runtime_error);
  float v;
  std::memcpy(&v, f->data("second") + 4 * 5, 4);
  EXPECT_EQ(v, 6.0f);
}

TEST(GGUFMetadata, TypeTable) {
  EXPECT_EQ(ggml_type_name(GGMLType::Q4_K), "Q4_K");
  EXPECT_EQ(ggml_type_name(GGMLType(99)), "unknown(99)");
  EXPECT_EQ(ggml_type_traits(GGMLType(4)), nullptr);  // removed Q4_2
  EXPECT_EQ(ggml_type_traits(GGMLType::Q6_K)->type_size, 210);
  EXPECT_EQ(ggml_type_traits(GGMLType::Q4_K)->type_size, 144);
  EXPECT_EQ(ggml_type_traits(GGMLType::Q4_1)->type_size, 20);
  EXPECT_EQ(ggml_type_traits(GGMLType::Q8_0)->block_size, 32);
  EXPECT_TRUE(ggml_can_dequantize(GGMLType::BF16));
  EXPECT_FALSE(ggml_can_dequantize(GGMLType::Q5_K));
}

// ---------------------------------------------------------------------------------------------
// Dequantization

TEST(GGUFDequant, FloatTypes) {
  GGUFBuilder b;
  b.tensor(f32_tensor("f32", {4}, {1.5f, -0.0f, 3e38f, -7.25f}));
  TensorSpec f16{"f16", {5, 2}, 1, {}, {}};
  const uint16_t hs[10] = {kH0_5, kHm1_25, kH0_25, kH2, kH0_125, kH1, kHm2, kH3, kH65504, kHsub};
  for (uint16_t h : hs) put<uint16_t>(f16.data, h);
  b.tensor(f16);
  TensorSpec bf{"bf16", {3}, 30, {}, {}};
  const float bvals[3] = {1.5f, -0.15625f, 3.0e20f};  // low 16 bits of the first two are zero
  std::vector<float> bexpect;
  for (float x : bvals) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    put<uint16_t>(bf.data, uint16_t(u >> 16));
    u &= 0xffff0000u;
    float t;
    std::memcpy(&t, &u, 4);
    bexpect.push_back(t);
  }
  b.tensor(bf);
  TempDir dir;
  auto f = open_bytes(dir, b.build());

  Tensor t = f->dequantize("f32");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(t.data, (std::vector<float>{1.5f, -0.0f, 3e38f, -7.25f}));
  EXPECT_TRUE(std::signbit(t.data[1]));

  t = f->dequantize("f16");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 5}));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(t.data[i], f16v(hs[i])) << i;

  t = f->dequantize("bf16");
  EXPECT_EQ(t.data, bexpect);
  EXPECT_EQ(t.data[0], 1.5f);
  EXPECT_EQ(t.data[1], -0.15625f);
}

TEST(GGUFDequant, Q8_0) {
  Lcg rng(1);
  const uint16_t ds[4] = {kH0_5, kHm1_25, kH0_125, kH2};
  TensorSpec t{"q8", {64, 2}, 8, {}, {}};  // 2 rows of 2 blocks
  std::vector<float> expect;
  for (int blk = 0; blk < 4; ++blk) {
    std::vector<int> q(32);
    for (int& x : q) x = rng.uniform(-128, 127);
    q[0] = -128;
    q[1] = 127;
    t.data += q8_0_block(ds[blk], q);
    for (int x : q) expect.push_back(float(double(f16v(ds[blk])) * x));
  }
  GGUFBuilder b;
  b.tensor(t);
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  Tensor out = f->dequantize("q8");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 64}));
  EXPECT_EQ(out.data, expect);
}

TEST(GGUFDequant, Q4_0AndQ4_1) {
  Lcg rng(2);
  const uint16_t ds[3] = {kH0_5, kHm1_25, kH2};
  const uint16_t ms[3] = {kHm1_25, kH0_125, kH3};
  TensorSpec t0{"q4_0", {32, 3}, 2, {}, {}}, t1{"q4_1", {96}, 3, {}, {}};
  std::vector<float> e0, e1;
  for (int blk = 0; blk < 3; ++blk) {
    std::vector<int> q(32);
    for (int& x : q) x = rng.uniform(0, 15);
    q[3] = 0;
    q[20] = 15;
    put<uint16_t>(t0.data, ds[blk]);
    t0.data += nibbles32(q);
    put<uint16_t>(t1.data, ds[blk]);
    put<uint16_t>(t1.data, ms[blk]);
    t1.data += nibbles32(q);
    for (int j = 0; j < 32; ++j) {
      e0.push_back(float((q[j] - 8) * double(f16v(ds[blk]))));
      e1.push_back(float(q[j] * double(f16v(ds[blk])) + f16v(ms[blk])));
    }
  }
  GGUFBuilder b;
  b.tensor(t0).tensor(t1);
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  Tensor a = f->dequantize("q4_0");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 32}));
  EXPECT_EQ(a.data, e0);
  Tensor c = f->dequantize("q4_1");
  EXPECT_EQ(c.shape, (std::vector<int64_t>{96}));
  EXPECT_EQ(c.data, e1);
  // Hand-checked corner: block 0, element 0 is (q0 - 8) * 0.5 and element 16 uses the high nibble.
}

TEST(GGUFDequant, Q4_0HandBlock) {
  // One block by hand: d = 0.5, byte j = (j & 15) | (15 - j) << 4.
  TensorSpec t{"h", {32}, 2, {}, {}};
  put<uint16_t>(t.data, kH0_5);
  for (int j = 0; j < 16; ++j) put<uint8_t>(t.data, uint8_t(j | ((15 - j) << 4)));
  GGUFBuilder b;
  b.tensor(t);
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  Tensor out = f->dequantize("h");
  EXPECT_EQ(out.data[0], -4.0f);   // (0 - 8) * 0.5
  EXPECT_EQ(out.data[15], 3.5f);   // (15 - 8) * 0.5
  EXPECT_EQ(out.data[16], 3.5f);   // high nibble of byte 0 = 15
  EXPECT_EQ(out.data[31], -4.0f);  // high nibble of byte 15 = 0
}

TEST(GGUFDequant, Q4_K) {
  Lcg rng(3);
  const uint16_t ds[2] = {kH0_5, kH0_125}, dmins[2] = {kH0_25, kH2};
  TensorSpec t{"q4k", {256, 2}, 12, {}, {}};
  std::vector<float> expect;
  for (int blk = 0; blk < 2; ++blk) {
    int sc[8], mn[8], q[256];
    for (int j = 0; j < 8; ++j) {
      sc[j] = rng.uniform(0, 63);
      mn[j] = rng.uniform(0, 63);
    }
    sc[5] = 63;  // exercise the high bits of the packed j >= 4 entries
    mn[6] = 48;
    sc[1] = 0;
    for (int& x : q) x = rng.uniform(0, 15);
    t.data += q4_k_block(ds[blk], dmins[blk], sc, mn, q);
    const double d = f16v(ds[blk]), dmin = f16v(dmins[blk]);
    for (int e = 0; e < 256; ++e) expect.push_back(float(d * sc[e / 32] * q[e] - dmin * mn[e / 32]));
  }
  GGUFBuilder b;
  b.tensor(t);
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  Tensor out = f->dequantize("q4k");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 256}));
  ASSERT_EQ(out.data.size(), expect.size());
  for (std::size_t i = 0; i < expect.size(); ++i) ASSERT_EQ(out.data[i], expect[i]) << i;
}

TEST(GGUFDequant, Q6_K) {
  Lcg rng(4);
  const uint16_t ds[3] = {kH0_25, kHm1_25, kH0_5};
  TensorSpec t{"q6k", {768}, 14, {}, {}};
  std::vector<float> expect;
  for (int blk = 0; blk < 3; ++blk) {
    int sc[16], q[256];
    for (int& s : sc) s = rng.uniform(-128, 127);
    sc[0] = -128;
    sc[15] = 127;
    for (int& x : q) x = rng.uniform(0, 63);
    q[0] = 0;
    q[255] = 63;
    t.data += q6_k_block(ds[blk], sc, q);
    const double d = f16v(ds[blk]);
    for (int e = 0; e < 256; ++e) expect.push_back(float(d * sc[e / 16] * (q[e] - 32)));
  }
  GGUFBuilder b;
  b.tensor(t);
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  Tensor out = f->dequantize("q6k");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{768}));
  ASSERT_EQ(out.data.size(), expect.size());
  for (std::size_t i = 0; i < expect.size(); ++i) ASSERT_EQ(out.data[i], expect[i]) << i;
}

TEST(GGUFDequant, KQuantKnownAnswers) {
  // One block whose byte i is (37 i + 11) mod 256, with the f16 scales overwritten (Q4_K:
  // d = 0.125, dmin = 0.25; Q6_K: d = 0.125). Expected values were produced once by the
  // independent numpy dequantizer of llama.cpp's gguf-py (gguf.quants.dequantize, gguf 0.19.0).
  const int idx[16] = {0, 1, 17, 31, 32, 63, 64, 100, 127, 128, 150, 191, 192, 200, 240, 255};
  const float q4k[16] = {29.875f, -12.75f, -12.75f, 10.5f,  -3.5f,   0.5f,  41.125f, 5.5f,
                         3.75f,   50.625f, 40.875f, 0.0f,   63.125f, 14.125f, -2.75f, -0.5f};
  const float q6k[16] = {-178.875f, 212.0f, 64.0f,   -12.0f,   28.875f, -72.5f,  -380.0f, 315.375f,
                         187.5f,    -43.875f, -21.0f, -122.5f, -60.5f,  136.125f, 16.25f, -7.5f};
  auto pattern = [](int n) {
    std::string s(std::size_t(n), '\0');
    for (int i = 0; i < n; ++i) s[std::size_t(i)] = char(uint8_t((i * 37 + 11) % 256));
    return s;
  };
  std::string b4 = pattern(144), b6 = pattern(210);
  std::memcpy(b4.data(), &kH0_125, 2);
  std::memcpy(b4.data() + 2, &kH0_25, 2);
  std::memcpy(b6.data() + 208, &kH0_125, 2);
  std::vector<float> y(256);
  ggml_dequantize(GGMLType::Q4_K, b4.data(), y.data(), 256);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(y[std::size_t(idx[i])], q4k[i]) << "Q4_K " << idx[i];
  ggml_dequantize(GGMLType::Q6_K, b6.data(), y.data(), 256);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(y[std::size_t(idx[i])], q6k[i]) << "Q6_K " << idx[i];
}

TEST(GGUFDequant, ShapeIsReversedNe) {
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[i] = float(i);
  GGUFBuilder b;
  b.tensor(f32_tensor("t3", {4, 3, 2}, v));
  b.tensor(f32_tensor("t4", {1, 2, 3, 4}, v));
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  Tensor t = f->dequantize("t3");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(t.data, v);  // element (i, j, k) = ne-order index k + 4 j + 12 i: row-major already
  EXPECT_EQ(t.data[1 * 12 + 2 * 4 + 3], 23.0f);
  EXPECT_EQ(f->dequantize("t4").shape, (std::vector<int64_t>{4, 3, 2, 1}));
}

TEST(GGUFDequant, UnsupportedTypeNamesTensorAndType) {
  GGUFBuilder b;
  b.tensor(TensorSpec{"blk.0.ffn_down.weight", {256}, 13, std::string(176, '\0'), {}});  // Q5_K
  TempDir dir;
  auto f = open_bytes(dir, b.build());
  EXPECT_EQ(f->tensors()[0].type_name(), "Q5_K");
  try {
    f->dequantize("blk.0.ffn_down.weight");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_CONTAINS(e.what(), "blk.0.ffn_down.weight");
    EXPECT_CONTAINS(e.what(), "Q5_K");
    EXPECT_CONTAINS(e.what(), "m.gguf");
  }
  float out[32];
  EXPECT_THROW(ggml_dequantize(GGMLType::Q4_0, std::string(18, '\0').data(), out, 31),
               std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// llama mapping

constexpr int64_t kHidden = 16, kHeads = 4, kKvHeads = 2, kHeadDim = 4, kFfn = 24, kVocab = 10;

/// convert_hf_to_gguf.py LlamaModel.permute, written as the numpy reshape/swapaxes it is:
/// w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).reshape(rows, cols).
std::vector<float> forward_permute(const std::vector<float>& w, int64_t rows, int64_t cols,
                                   int64_t n_head) {
  const int64_t half = rows / n_head / 2;
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < n_head; ++h)
    for (int64_t a = 0; a < 2; ++a)        // axis 1 before the swap
      for (int64_t i = 0; i < half; ++i)   // axis 2 before the swap
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t src = ((h * 2 + a) * half + i) * cols + c;       // [h][a][i][c]
          const int64_t dst = ((h * half + i) * 2 + a) * cols + c;       // [h][i][a][c]
          out[std::size_t(dst)] = w[std::size_t(src)];
        }
  return out;
}

std::vector<float> iota_matrix(int64_t rows, int64_t cols, float base) {
  std::vector<float> v(std::size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) v[std::size_t(r * cols + c)] = base + float(r) * 100 + float(c);
  return v;
}

/// A two-layer llama GGUF with F32 tensors holding recognisable values. Q and K are stored
/// permuted as llama.cpp's converter stores them.
GGUFBuilder llama_builder(bool with_output, bool with_vocab_key, bool with_optional_keys) {
  GGUFBuilder b;
  b.kv_str("general.architecture", "llama")
      .kv<uint32_t>("llama.embedding_length", kU32, uint32_t(kHidden))
      .kv<uint32_t>("llama.feed_forward_length", kU32, uint32_t(kFfn))
      .kv<uint32_t>("llama.block_count", kU32, 2)
      .kv<uint32_t>("llama.attention.head_count", kU32, uint32_t(kHeads))
      .kv<uint32_t>("llama.attention.head_count_kv", kU32, uint32_t(kKvHeads))
      .kv<float>("llama.attention.layer_norm_rms_epsilon", kF32, 1e-5f)
      .kv<uint32_t>("llama.context_length", kU32, 2048)
      .kv<uint32_t>("tokenizer.ggml.bos_token_id", kU32, 1)
      .kv<uint32_t>("tokenizer.ggml.eos_token_id", kU32, 2)
      .kv_arr("tokenizer.ggml.tokens",
              arr_of_str({"<unk>", "<s>", "</s>", "a", "b", "c", "d", "e", "f", "g"}));
  if (with_vocab_key) b.kv<uint32_t>("llama.vocab_size", kU32, uint32_t(kVocab));
  if (with_optional_keys) {
    b.kv<float>("llama.rope.freq_base", kF32, 100000.0f)
        .kv<uint32_t>("llama.attention.key_length", kU32, uint32_t(kHeadDim))
        .kv<uint32_t>("llama.rope.dimension_count", kU32, uint32_t(kHeadDim));
  }
  b.tensor(f32_tensor("token_embd.weight", {kHidden, kVocab}, iota_matrix(kVocab, kHidden, 0)));
  b.tensor(f32_tensor("output_norm.weight", {kHidden}, iota_matrix(1, kHidden, 0.5f)));
  if (with_output)
    b.tensor(f32_tensor("output.weight", {kHidden, kVocab}, iota_matrix(kVocab, kHidden, 7)));
  for (int l = 0; l < 2; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    const float base = 10000.0f * float(l + 1);
    b.tensor(f32_tensor(p + "attn_norm.weight", {kHidden}, iota_matrix(1, kHidden, base + 1)));
    b.tensor(f32_tensor(p + "attn_q.weight", {kHidden, kHeads * kHeadDim},
                        forward_permute(iota_matrix(kHeads * kHeadDim, kHidden, base + 2),
                                        kHeads * kHeadDim, kHidden, kHeads)));
    b.tensor(f32_tensor(p + "attn_k.weight", {kHidden, kKvHeads * kHeadDim},
                        forward_permute(iota_matrix(kKvHeads * kHeadDim, kHidden, base + 3),
                                        kKvHeads * kHeadDim, kHidden, kKvHeads)));
    b.tensor(f32_tensor(p + "attn_v.weight", {kHidden, kKvHeads * kHeadDim},
                        iota_matrix(kKvHeads * kHeadDim, kHidden, base + 4)));
    b.tensor(f32_tensor(p + "attn_output.weight", {kHeads * kHeadDim, kHidden},
                        iota_matrix(kHidden, kHeads * kHeadDim, base + 5)));
    b.tensor(f32_tensor(p + "ffn_norm.weight", {kHidden}, iota_matrix(1, kHidden, base + 6)));
    b.tensor(f32_tensor(p + "ffn_gate.weight", {kHidden, kFfn}, iota_matrix(kFfn, kHidden, base + 7)));
    b.tensor(f32_tensor(p + "ffn_up.weight", {kHidden, kFfn}, iota_matrix(kFfn, kHidden, base + 8)));
    b.tensor(f32_tensor(p + "ffn_down.weight", {kFfn, kHidden}, iota_matrix(kHidden, kFfn, base + 9)));
  }
  b.tensor(f32_tensor("blk.0.mystery.weight", {2}, {1, 2}));
  return b;
}

TEST(GGUFLlama, NameMapping) {
  EXPECT_EQ(gguf_llama_hf_name("token_embd.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(gguf_llama_hf_name("output_norm.weight"), "model.norm.weight");
  EXPECT_EQ(gguf_llama_hf_name("output.weight"), "lm_head.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.12.attn_norm.weight"), "model.layers.12.input_layernorm.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.0.attn_q.weight"), "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.0.attn_k.weight"), "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.0.attn_v.weight"), "model.layers.0.self_attn.v_proj.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.0.attn_output.weight"), "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.3.ffn_norm.weight"),
            "model.layers.3.post_attention_layernorm.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.3.ffn_gate.weight"), "model.layers.3.mlp.gate_proj.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.3.ffn_up.weight"), "model.layers.3.mlp.up_proj.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.3.ffn_down.weight"), "model.layers.3.mlp.down_proj.weight");
  EXPECT_EQ(gguf_llama_hf_name("blk.3.attn_q.bias"), "model.layers.3.self_attn.q_proj.bias");
  for (const char* kept : {"blk.0.mystery.weight", "blk.x.attn_q.weight", "rope_freqs.weight",
                           "output", "blk.1.attn_q.scale", "token_embd"})
    EXPECT_EQ(gguf_llama_hf_name(kept), kept);
}

TEST(GGUFLlama, ModelSpecFromMetadata) {
  TempDir dir;
  auto f = open_bytes(dir, llama_builder(true, true, true).build());
  EXPECT_EQ(f->architecture(), "llama");
  ModelSpec s = gguf_model_spec(*f);
  EXPECT_EQ(s.arch, Arch::Llama);
  EXPECT_EQ(s.architecture, "LlamaForCausalLM");
  EXPECT_EQ(s.model_type, "llama");
  EXPECT_EQ(s.weight_prefix, "model.");
  EXPECT_EQ(s.hidden_size, kHidden);
  EXPECT_EQ(s.intermediate_size, kFfn);
  EXPECT_EQ(s.num_hidden_layers, 2);
  EXPECT_EQ(s.num_attention_heads, kHeads);
  EXPECT_EQ(s.num_key_value_heads, kKvHeads);
  EXPECT_EQ(s.head_dim, kHeadDim);
  EXPECT_EQ(s.vocab_size, kVocab);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_EQ(s.rope.type, "default");
  EXPECT_EQ(s.rope.theta, 100000.0);
  EXPECT_EQ(s.rope.partial_rotary_factor, 1.0);
  EXPECT_EQ(s.max_position_embeddings, 2048);
  EXPECT_FALSE(s.tie_word_embeddings);
  EXPECT_EQ(s.hidden_act, "silu");
  EXPECT_EQ(s.layer_types, std::vector<LayerKind>(2, LayerKind::Attention));
  EXPECT_EQ(s.bos_token_id, 1);
  EXPECT_EQ(s.eos_token_ids, std::vector<int64_t>{2});

  // Defaults: vocab from the token list, head_dim = hidden / heads, rope theta 10000; tied.
  auto g = open_bytes(dir, llama_builder(false, false, false).build(), "g.gguf");
  ModelSpec t = gguf_model_spec(*g);
  EXPECT_EQ(t.vocab_size, kVocab);
  EXPECT_EQ(t.head_dim, kHidden / kHeads);
  EXPECT_EQ(t.rope.theta, 10000.0);
  EXPECT_TRUE(t.tie_word_embeddings);
}

TEST(GGUFLlama, WeightsUnderHFNamesWithQKUnpermuted) {
  TempDir dir;
  write_file(dir / "l.gguf", llama_builder(true, true, true).build());
  GGUFWeights w((dir / "l.gguf").string());
  EXPECT_EQ(w.origin(), (dir / "l.gguf").string());
  const auto names = w.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(names.size(), 3u + 2u * 9u + 1u);
  const std::set<std::string> ns(names.begin(), names.end());
  for (const char* n : {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                        "model.layers.1.self_attn.o_proj.weight", "blk.0.mystery.weight"})
    EXPECT_TRUE(ns.count(n) && w.has(n)) << n;
  EXPECT_FALSE(w.has("token_embd.weight"));
  EXPECT_EQ(w.gguf_name("model.layers.1.mlp.up_proj.weight"), "blk.1.ffn_up.weight");

  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const float base = 10000.0f * float(l + 1);
    Tensor q = w.load_f32(p + "self_attn.q_proj.weight");
    EXPECT_EQ(q.shape, (std::vector<int64_t>{kHeads * kHeadDim, kHidden}));
    EXPECT_EQ(q.data, iota_matrix(kHeads * kHeadDim, kHidden, base + 2)) << l;
    Tensor k = w.load_f32(p + "self_attn.k_proj.weight");
    EXPECT_EQ(k.shape, (std::vector<int64_t>{kKvHeads * kHeadDim, kHidden}));
    EXPECT_EQ(k.data, iota_matrix(kKvHeads * kHeadDim, kHidden, base + 3)) << l;
    EXPECT_EQ(w.load_f32(p + "self_attn.v_proj.weight").data,
              iota_matrix(kKvHeads * kHeadDim, kHidden, base + 4));
    Tensor o = w.load_f32(p + "self_attn.o_proj.weight");
    EXPECT_EQ(o.shape, (std::vector<int64_t>{kHidden, kHeads * kHeadDim}));
    EXPECT_EQ(o.data, iota_matrix(kHidden, kHeads * kHeadDim, base + 5));
    EXPECT_EQ(w.load_f32(p + "mlp.down_proj.weight").shape, (std::vector<int64_t>{kHidden, kFfn}));
    EXPECT_EQ(w.load_f32(p + "input_layernorm.weight").data, iota_matrix(1, kHidden, base + 1));
    EXPECT_EQ(w.load_f32(p + "post_attention_layernorm.weight").data,
              iota_matrix(1, kHidden, base + 6));
  }
  // The stored (permuted) Q differs from HF order: the un-permutation really did something.
  EXPECT_NE(w.file().dequantize("blk.0.attn_q.weight").data,
            iota_matrix(kHeads * kHeadDim, kHidden, 10002));
  EXPECT_EQ(w.load_f32("model.embed_tokens.weight").shape, (std::vector<int64_t>{kVocab, kHidden}));

  TensorInfo info = w.info("model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(info.name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(info.dtype, DType::F32);
  EXPECT_EQ(info.storage, "F32");
  EXPECT_EQ(info.shape, (std::vector<int64_t>{kHeads * kHeadDim, kHidden}));
  EXPECT_CONTAINS(info.file, "l.gguf (F32)");
  EXPECT_THROW(w.info("model.layers.9.mlp.up_proj.weight"), std::runtime_error);
  try {
    w.load_f32("nope.weight");
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_CONTAINS(e.what(), "nope.weight");
    EXPECT_CONTAINS(e.what(), "l.gguf");
  }
}

TEST(GGUFLlama, UnpermuteBiasAndBadRows) {
  Tensor bias({8});
  for (int i = 0; i < 8; ++i) bias.data[i] = float(i);
  const std::vector<float> orig = bias.data;
  bias.data = forward_permute(orig, 8, 1, 2);
  EXPECT_EQ(bias.data, (std::vector<float>{0, 2, 1, 3, 4, 6, 5, 7}));
  gguf_unpermute_qk_rows(bias, 2, "bias");
  EXPECT_EQ(bias.data, orig);
  Tensor bad({6, 2});
  EXPECT_THROW(gguf_unpermute_qk_rows(bad, 2, "bad"), std::runtime_error);
}

TEST(GGUFLlama, RejectsOtherArchitecturesAndBadMetadata) {
  {
    GGUFBuilder b;
    b.kv_str("general.architecture", "qwen2");
    TempDir dir;
    auto f = open_bytes(dir, b.build());
    try {
      gguf_model_spec(*f);
      ADD_FAILURE();
    } catch (const std::runtime_error& e) {
      EXPECT_CONTAINS(e.what(), "qwen2");
      EXPECT_CONTAINS(e.what(), "llama");
      EXPECT_CONTAINS(e.what(), "m.gguf");
    }
    EXPECT_THROW(GGUFWeights(f->path()), std::runtime_error);
  }
  {
    GGUFBuilder b;  // no architecture at all
    TempDir dir;
    auto f = open_bytes(dir, b.build());
    EXPECT_THROW(gguf_model_spec(*f), std::runtime_error);
  }
  {
    GGUFBuilder b;  // llama but a required key missing
    b.kv_str("general.architecture", "llama");
    TempDir dir;
    auto f = open_bytes(dir, b.build());
    try {
      gguf_model_spec(*f);
      ADD_FAILURE();
    } catch (const std::runtime_error& e) {
      EXPECT_CONTAINS(e.what(), "llama.embedding_length");
    }
  }
  {
    GGUFBuilder b = llama_builder(true, true, false);  // key of the wrong type
    b.kv_str("llama.rope.freq_base", "fast");
    TempDir dir;
    auto f = open_bytes(dir, b.build());
    try {
      gguf_model_spec(*f);
      ADD_FAILURE();
    } catch (const std::runtime_error& e) {
      EXPECT_CONTAINS(e.what(), "llama.rope.freq_base");
    }
  }
  {
    GGUFBuilder b = llama_builder(true, false, false);  // vocab_size disagrees with token_embd
    b.kv<uint32_t>("llama.vocab_size", kU32, 11);
    TempDir dir;
    auto f = open_bytes(dir, b.build());
    EXPECT_THROW(gguf_model_spec(*f), std::runtime_error);
  }
  {
    GGUFBuilder b = llama_builder(true, true, false);  // MoE
    b.kv<uint32_t>("llama.expert_count", kU32, 8);
    TempDir dir;
    auto f = open_bytes(dir, b.build());
    EXPECT_THROW(gguf_model_spec(*f), std::runtime_error);
  }
  {
    GGUFBuilder b = llama_builder(true, true, false);  // two names for lm_head.weight
    b.tensor(f32_tensor("lm_head.weight", {1}, {0}));
    TempDir dir;
    write_file(dir / "d.gguf", b.build());
    EXPECT_THROW(GGUFWeights((dir / "d.gguf").string()), std::runtime_error);
  }
}

// ---------------------------------------------------------------------------------------------
// Hostile files

std::string header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
  std::string s = "GGUF";
  put<uint32_t>(s, version);
  put<uint64_t>(s, n_tensors);
  put<uint64_t>(s, n_kv);
  return s;
}

TEST(GGUFHostile, BadMagicAndVersion) {
  std::string good = all_types_builder().build();
  std::string bad = good;
  bad[0] = 'X';
  EXPECT_CONTAINS(open_error(bad), "magic");
  for (uint32_t v : {0u, 1u, 4u, 0x03000000u}) {
    bad = good;
    std::memcpy(bad.data() + 4, &v, 4);
    EXPECT_CONTAINS(open_error(bad), "version");
  }
  EXPECT_CONTAINS(open_error(""), "too small");
  TempDir dir;
  EXPECT_THROW(GGUFFile((dir / "missing.gguf").string()), std::runtime_error);
  EXPECT_THROW(GGUFFile(dir.path().string()), std::runtime_error);  // a directory
}

TEST(GGUFHostile, EveryTruncationThrows) {
  GGUFBuilder b = all_types_builder();
  b.kv_str("general.architecture", "llama");
  b.tensor(f32_tensor("a", {3}, {1, 2, 3}));
  TensorSpec q{"q", {32}, 8, q8_0_block(kH0_5, std::vector<int>(32, 3)), {}};
  b.tensor(q);
  const std::string full = b.build();
  TempDir dir;
  {
    write_file(dir / "full.gguf", full);
    GGUFFile ok((dir / "full.gguf").string());
    EXPECT_EQ(ok.tensors().size(), 2u);
  }
  const auto p = (dir / "t.gguf").string();
  for (std::size_t n = 0; n < full.size(); ++n) {
    write_file(p, full.substr(0, n));
    EXPECT_THROW(GGUFFile{p}, std::runtime_error) << "truncated to " << n << " of " << full.size();
  }
}

TEST(GGUFHostile, HugeLengthsAndCounts) {
  {  // key string length 2^62
    std::string s = header(0, 1);
    put<uint64_t>(s, uint64_t(1) << 62);
    s += std::string(64, 'a');
    EXPECT_CONTAINS(open_error(s), "length");
  }
  {  // string value length far past the end
    std::string s = header(0, 1);
    put_str(s, "k");
    put<uint32_t>(s, kStr);
    put<uint64_t>(s, ~uint64_t(0));
    EXPECT_CONTAINS(open_error(s), "length");
  }
  for (uint32_t et : {uint32_t(kU8), uint32_t(kStr), uint32_t(kArr), uint32_t(kF64)}) {
    std::string s = header(0, 1);  // array count 2^60
    put_str(s, "big.array");
    put<uint32_t>(s, kArr);
    put<uint32_t>(s, et);
    put<uint64_t>(s, uint64_t(1) << 60);
    s += std::string(64, '\0');
    EXPECT_CONTAINS(open_error(s), "big.array");
  }
  {
    std::string s = header(uint64_t(1) << 60, 0);
    s += std::string(64, '\0');
    EXPECT_CONTAINS(open_error(s), "tensor count");
  }
  {
    std::string s = header(0, ~uint64_t(0));
    s += std::string(64, '\0');
    EXPECT_CONTAINS(open_error(s), "metadata count");
  }
  {  // arrays nested 100 deep: an error, not a stack overflow
    std::string s = header(0, 1);
    put_str(s, "deep");
    put<uint32_t>(s, kArr);
    for (int i = 0; i < 100; ++i) {
      put<uint32_t>(s, kArr);
      put<uint64_t>(s, 1);
    }
    put<uint32_t>(s, kU8);
    put<uint64_t>(s, 0);
    EXPECT_CONTAINS(open_error(s), "nested");
  }
}

TEST(GGUFHostile, BadValues) {
  {
    std::string s = header(0, 1);
    put_str(s, "flag");
    put<uint32_t>(s, kBool);
    put<uint8_t>(s, 2);
    EXPECT_CONTAINS(open_error(s), "flag");
  }
  {
    std::string s = header(0, 1);
    put_str(s, "weird");
    put<uint32_t>(s, 13);
    put<uint64_t>(s, 0);
    EXPECT_CONTAINS(open_error(s), "weird");
  }
  {
    GGUFBuilder b;
    b.kv<uint32_t>("dup", kU32, 1).kv<uint32_t>("dup", kU32, 2);
    EXPECT_CONTAINS(open_error(b.build()), "dup");
  }
  for (uint32_t a : {0u, 3u, 48u}) {
    GGUFBuilder b;
    b.kv<uint32_t>("general.alignment", kU32, a);
    b.tensor(f32_tensor("a", {1}, {1}));
    EXPECT_CONTAINS(open_error(b.build()), "general.alignment");
  }
  {
    GGUFBuilder b;
    b.kv_str("general.alignment", "32");
    EXPECT_CONTAINS(open_error(b.build()), "general.alignment");
  }
}

TEST(GGUFHostile, BadTensorInfos) {
  auto one = [](TensorSpec t) {
    GGUFBuilder b;
    b.tensor(f32_tensor("ok", {2}, {1, 2}));
    b.tensor(std::move(t));
    return open_error(b.build());
  };
  EXPECT_CONTAINS(one(TensorSpec{"five", {1, 1, 1, 1, 1}, 0, std::string(4, '\0'), {}}), "five");
  EXPECT_CONTAINS(one(TensorSpec{"zero_dims", {}, 0, std::string(4, '\0'), {}}), "zero_dims");
  EXPECT_CONTAINS(one(TensorSpec{"past_eof", {4}, 0, std::string(16, '\0'), uint64_t(1) << 20}),
                  "past_eof");
  EXPECT_CONTAINS(one(TensorSpec{"wrapping", {4}, 0, std::string(16, '\0'), ~uint64_t(0) - 31}),
                  "wrapping");
  EXPECT_CONTAINS(one(TensorSpec{"misaligned", {4}, 0, std::string(16, '\0'), 8}), "misaligned");
  const std::string m = one(TensorSpec{"strange", {4}, 99, std::string(16, '\0'), {}});
  EXPECT_CONTAINS(m, "strange");
  EXPECT_CONTAINS(m, "99");
  EXPECT_CONTAINS(one(TensorSpec{"removed_q4_2", {32}, 4, std::string(20, '\0'), {}}), "removed_q4_2");
  EXPECT_CONTAINS(one(TensorSpec{"ragged", {16}, 8, std::string(34, '\0'), {}}), "ragged");
  EXPECT_CONTAINS(one(TensorSpec{"ok", {2}, 0, std::string(8, '\0'), {}}), "duplicate tensor name 'ok'");
  EXPECT_CONTAINS(one(TensorSpec{"overflow", {uint64_t(1) << 40, uint64_t(1) << 40}, 0, "", {}}),
                  "overflow");
  EXPECT_CONTAINS(one(TensorSpec{"neg", {~uint64_t(0)}, 0, "", {}}), "neg");
  EXPECT_CONTAINS(one(TensorSpec{"short_data", {8}, 0, std::string(16, '\0'), {}}), "short_data");
}

// ---------------------------------------------------------------------------------------------
// The real SmolLM2-135M-Instruct GGUF (skipped unless DFLASH_SMOLLM2_GGUF names it).

TEST(GGUFReal, SmolLM2) {
  const char* path = std::getenv("DFLASH_SMOLLM2_GGUF");
  if (!path || !*path) GTEST_SKIP() << "set DFLASH_SMOLLM2_GGUF to a SmolLM2-135M-Instruct GGUF";
  auto file = std::make_shared<const GGUFFile>(path);
  std::map<std::string, int> types;
  for (const auto& t : file->tensors()) ++types[t.type_name()];
  std::string summary;
  for (const auto& [k, v] : types) summary += k + ":" + std::to_string(v) + " ";
  std::printf("GGUF v%u, %zu tensors (%s), %zu metadata keys\n", file->version(),
              file->tensors().size(), summary.c_str(), file->metadata().size());
  for (const auto& [k, v] : file->metadata().items()) {
    std::string s = v.is_array() ? "[array of " + std::to_string(v.size()) + "]" : v.dump();
    if (s.size() > 80) s = s.substr(0, 77) + "...";
    std::printf("  %s = %s\n", k.c_str(), s.c_str());
  }

  GGUFWeights w(file);
  const ModelSpec& s = w.spec();
  EXPECT_EQ(s.hidden_size, 576);
  EXPECT_EQ(s.num_hidden_layers, 30);
  EXPECT_EQ(s.num_attention_heads, 9);
  EXPECT_EQ(s.num_key_value_heads, 3);
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_EQ(s.vocab_size, 49152);
  EXPECT_EQ(s.intermediate_size, 1536);
  EXPECT_EQ(s.rope.theta, 100000.0);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);

  int64_t total = 0;
  for (const auto& name : w.names()) {
    Tensor t = w.load_f32(name);
    EXPECT_EQ(t.shape, w.info(name).shape) << name;
    for (float x : t.data) ASSERT_TRUE(std::isfinite(x)) << name;
    total += t.numel();
  }
  EXPECT_EQ(w.load_f32("model.embed_tokens.weight").shape, (std::vector<int64_t>{49152, 576}));
  EXPECT_EQ(w.load_f32("model.layers.0.self_attn.k_proj.weight").shape,
            (std::vector<int64_t>{192, 576}));
  std::printf("dequantized %zu tensors, %lld parameters\n", w.names().size(), (long long)total);
}

}  // namespace
}  // namespace dflash
