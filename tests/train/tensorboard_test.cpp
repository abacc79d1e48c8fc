// TensorBoard event files: CRC-32C against its standard check value, the TFRecord framing and Event
// encoding read back by an independent decoder here, and (when python3 can import tensorboard) by
// TensorBoard's own event loader.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "test_util.h"
#include "train/tensorboard.h"

using namespace dflash;

namespace {

uint64_t read_varint(const std::string& s, size_t& i) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t b = uint8_t(s.at(i++));
    v |= uint64_t(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
}

/// Minimal protobuf walk: field number -> raw value (varint / fixed as bytes / length-delimited).
std::multimap<int, std::string> fields(const std::string& s) {
  std::multimap<int, std::string> r;
  for (size_t i = 0; i < s.size();) {
    const uint64_t key = read_varint(s, i);
    const int field = int(key >> 3), wire = int(key & 7);
    if (wire == 0) {
      const uint64_t v = read_varint(s, i);
      r.emplace(field, std::string(reinterpret_cast<const char*>(&v), 8));
    } else if (wire == 1) {
      r.emplace(field, s.substr(i, 8)), i += 8;
    } else if (wire == 5) {
      r.emplace(field, s.substr(i, 4)), i += 4;
    } else if (wire == 2) {
      const uint64_t n = read_varint(s, i);
      r.emplace(field, s.substr(i, n)), i += n;
    } else {
      throw std::runtime_error("bad wire type");
    }
  }
  return r;
}

template <typename T>
T as(const std::string& b) {
  T v;
  std::memcpy(&v, b.data(), sizeof(T));
  return v;
}

}  // namespace

TEST(TensorBoard, Crc32cCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value (RFC 3720)
  EXPECT_EQ(crc32c("", 0), 0u);
}

TEST(TensorBoard, EventsDecodeAndTensorBoardReadsThem) {
  test::TempDir d;
  std::string path;
  {
    TensorBoardWriter w(d.path().string());
    path = w.path();
    w.scalars(10, {{"train/loss", 2.5}, {"train/acc", 0.25}});
    w.scalars(20, {{"train/loss", 1.5}});
  }
  std::ifstream f(path, std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(f)), {});
  std::vector<std::string> events;
  for (size_t i = 0; i < all.size();) {
    const uint64_t n = as<uint64_t>(all.substr(i, 8));
    EXPECT_EQ(as<uint32_t>(all.substr(i + 8, 4)), masked_crc32c(all.data() + i, 8));
    const std::string data = all.substr(i + 12, n);
    EXPECT_EQ(as<uint32_t>(all.substr(i + 12 + n, 4)), masked_crc32c(data.data(), data.size()));
    events.push_back(data);
    i += 12 + n + 4;
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(fields(events[0]).find(3)->second, "brain.Event:2");
  const auto e1 = fields(events[1]);
  EXPECT_EQ(as<int64_t>(e1.find(2)->second), 10);
  EXPECT_GT(as<double>(e1.find(1)->second), 1.7e9);  // wall time in seconds
  std::map<std::string, float> v;
  const auto summary = fields(e1.find(5)->second);
  for (auto [it, end] = summary.equal_range(1); it != end; ++it) {
    const auto val = fields(it->second);
    v[val.find(1)->second] = as<float>(val.find(2)->second);
  }
  EXPECT_EQ(v["train/loss"], 2.5f);
  EXPECT_EQ(v["train/acc"], 0.25f);

  std::string out;
  if (test::run_command("python3 -c 'import tensorboard' 2>&1", &out) != 0) {
    std::printf("[tensorboard] python3 cannot import tensorboard: TensorBoard's own reader not run\n");
    return;
  }
  const std::string py =
      "from tensorboard.backend.event_processing.event_file_loader import EventFileLoader\n"
      "for e in EventFileLoader('" + path + "').Load():\n"
      "    for v in e.summary.value:\n"
      "        print(e.step, v.tag, v.tensor.float_val[0] if v.tensor.float_val else v.simple_value)\n";
  test::write_file(d / "read.py", py);
  ASSERT_EQ(test::run_command("python3 " + (d / "read.py").string(), &out), 0) << out;
  EXPECT_NE(out.find("10 train/loss 2.5"), std::string::npos) << out;
  EXPECT_NE(out.find("10 train/acc 0.25"), std::string::npos) << out;
  EXPECT_NE(out.find("20 train/loss 1.5"), std::string::npos) << out;
  std::printf("[tensorboard] read back by TensorBoard's EventFileLoader:\n%s", out.c_str());
}
