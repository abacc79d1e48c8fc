#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace dflash {

namespace {

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli polynomial
    t[i] = c;
  }
  return t;
}

void varint(std::string& s, uint64_t v) {
  while (v >= 0x80) {
    s.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  s.push_back(char(v));
}

template <typename T>
void fixed(std::string& s, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian host (x86-64, aarch64)
  s.append(b, sizeof(T));
}

void bytes_field(std::string& s, int field, const std::string& b) {
  varint(s, uint64_t(field) << 3 | 2);
  varint(s, b.size());
  s += b;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string event_head(double wall, int64_t step) {
  std::string e;
  varint(e, 1 << 3 | 1);
  fixed(e, wall);
  varint(e, 2 << 3 | 0);
  varint(e, uint64_t(step));
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = make_table();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(int64_t(now_s())) + "." + host + "." + std::to_string(::getpid());
  f_ = std::fopen(path_.c_str(), "wb");
  if (!f_) throw std::runtime_error("cannot create " + path_ + ": " + std::strerror(errno));
  std::string e = event_head(now_s(), 0);
  bytes_field(e, 3, "brain.Event:2");
  record(e);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string val;
    bytes_field(val, 1, tag);
    varint(val, 2 << 3 | 5);
    fixed(val, float(v));
    bytes_field(summary, 1, val);
  }
  std::string e = event_head(now_s(), step);
  bytes_field(e, 5, summary);
  record(e);
}

void TensorBoardWriter::record(const std::string& data) {
  std::string r;
  fixed(r, uint64_t(data.size()));
  const uint32_t len_crc = masked_crc32c(r.data(), 8);
  fixed(r, len_crc);
  r += data;
  fixed(r, masked_crc32c(data.data(), data.size()));
  if (std::fwrite(r.data(), 1, r.size(), f_) != r.size() || std::fflush(f_) != 0)
    throw std::runtime_error("cannot write " + path_ + ": " + std::strerror(errno));
}

}  // namespace dflash
