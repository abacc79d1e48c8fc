#include "text/packed.h"

#include "io/json_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace dflash {

namespace {

std::FILE* create(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "wbx");  // x: fail if it exists
  if (!f) throw std::runtime_error(path + ": cannot create: " + std::strerror(errno));
  return f;
}

void write_or_throw(std::FILE* f, const void* p, size_t n, const std::string& path) {
  if (n && std::fwrite(p, 1, n, f) != n) throw std::runtime_error(path + ": write failed: " + std::strerror(errno));
}

void close_synced(std::FILE*& f, const std::string& path) {
  if (!f) return;
  const bool ok = std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  const int e = errno;
  std::fclose(f);
  f = nullptr;
  if (!ok) throw std::runtime_error(path + ": flush failed: " + std::strerror(e));
}

}  // namespace

PackedWriter::PackedWriter(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  if (!std::filesystem::create_directory(dir, ec))
    throw std::runtime_error(dir + ": cannot create directory" + (ec ? ": " + ec.message() : " (it exists)"));
  tokens_ = create(dir + "/tokens.i32");
  mask_ = create(dir + "/loss_mask.u8");
}

PackedWriter::~PackedWriter() {
  if (tokens_) std::fclose(tokens_);
  if (mask_) std::fclose(mask_);
}

void PackedWriter::add(const Sample& s) {
  if (s.ids.size() != s.loss_mask.size()) throw std::invalid_argument("PackedWriter: ids and loss_mask differ in length");
  write_or_throw(tokens_, s.ids.data(), s.ids.size() * sizeof(int32_t), dir_ + "/tokens.i32");
  write_or_throw(mask_, s.loss_mask.data(), s.loss_mask.size(), dir_ + "/loss_mask.u8");
  offsets_.push_back(offsets_.back() + int64_t(s.ids.size()));
  for (uint8_t m : s.loss_mask) loss_tokens_ += m;
}

bool is_packed_dir(const std::string& dir) {
  try {
    return read_json_file(dir + "/manifest.json").value("format", "") == kPackedFormat;
  } catch (const std::exception&) {
    return false;
  }
}

void PackedWriter::finish(nlohmann::json manifest) {
  close_synced(tokens_, dir_ + "/tokens.i32");
  close_synced(mask_, dir_ + "/loss_mask.u8");
  std::FILE* off = create(dir_ + "/offsets.i64");
  try {
    write_or_throw(off, offsets_.data(), offsets_.size() * sizeof(int64_t), dir_ + "/offsets.i64");
  } catch (...) {
    std::fclose(off);
    throw;
  }
  close_synced(off, dir_ + "/offsets.i64");
  manifest["format"] = kPackedFormat;
  manifest["num_samples"] = num_samples();
  manifest["num_tokens"] = num_tokens();
  manifest["num_loss_tokens"] = num_loss_tokens();
  const std::string text = manifest.dump(2) + "\n";
  std::FILE* m = create(dir_ + "/manifest.json");
  try {
    write_or_throw(m, text.data(), text.size(), dir_ + "/manifest.json");
  } catch (...) {
    std::fclose(m);
    throw;
  }
  close_synced(m, dir_ + "/manifest.json");
}

PackedDataset::PackedDataset(const std::string& dir)
    : dir_(dir), tokens_(dir + "/tokens.i32"), mask_(dir + "/loss_mask.u8") {
  const std::string mpath = dir + "/manifest.json";
  manifest_ = read_json_file(mpath, 1ull << 30);
  if (manifest_.value("format", "") != kPackedFormat)
    throw std::runtime_error(mpath + ": not a " + std::string(kPackedFormat) + " manifest");
  MappedFile off(dir + "/offsets.i64");
  if (off.size() % sizeof(int64_t) != 0 || off.size() < sizeof(int64_t))
    throw std::runtime_error(off.path() + ": size " + std::to_string(off.size()) + " is not a whole number of int64");
  offsets_.resize(off.size() / sizeof(int64_t));
  std::memcpy(offsets_.data(), off.data(), off.size());
  if (offsets_.front() != 0) throw std::runtime_error(off.path() + ": offsets[0] is not 0");
  for (size_t i = 1; i < offsets_.size(); ++i)
    if (offsets_[i] < offsets_[i - 1]) throw std::runtime_error(off.path() + ": offsets decrease at " + std::to_string(i));
  const auto n = uint64_t(offsets_.back());
  if (tokens_.size() != n * sizeof(int32_t))
    throw std::runtime_error(tokens_.path() + ": holds " + std::to_string(tokens_.size()) + " bytes, offsets say " +
                             std::to_string(n) + " tokens");
  if (mask_.size() != n) throw std::runtime_error(mask_.path() + ": length does not match tokens.i32");
  auto count = [&](const char* k) {  // (a non-integer count never matches)
    const auto it = manifest_.find(k);
    return it != manifest_.end() && it->is_number_integer() ? it->get<int64_t>() : int64_t(-1);
  };
  if (count("num_samples") != num_samples() || count("num_tokens") != num_tokens())
    throw std::runtime_error(mpath + ": counts disagree with the data files");
}

std::span<const int32_t> PackedDataset::ids(int64_t i) const {
  if (i < 0 || i >= num_samples()) throw std::out_of_range(dir_ + ": sample " + std::to_string(i) + " out of range");
  return {reinterpret_cast<const int32_t*>(tokens_.data()) + offsets_[size_t(i)],
          size_t(offsets_[size_t(i) + 1] - offsets_[size_t(i)])};
}

std::span<const uint8_t> PackedDataset::loss_mask(int64_t i) const {
  if (i < 0 || i >= num_samples()) throw std::out_of_range(dir_ + ": sample " + std::to_string(i) + " out of range");
  return {mask_.data() + offsets_[size_t(i)], size_t(offsets_[size_t(i) + 1] - offsets_[size_t(i)])};
}

}  // namespace dflash
