// Packed, memory-mapped training files: every sample's ids and loss mask back to back, with offsets.
// A directory holds tokens.i32 (int32 [N]), loss_mask.u8 (uint8 [N]), offsets.i64 (int64 [S + 1],
// offsets[0] = 0, offsets[S] = N) and manifest.json (format "dflash-packed-v1", counts, sources,
// skipped records). All little-endian.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "io/mapped_file.h"
#include "text/sample.h"

namespace dflash {

inline constexpr const char* kPackedFormat = "dflash-packed-v1";

/// True when `dir` holds a dflash-packed-v1 manifest.json (the output of dflash prepare). Never throws.
bool is_packed_dir(const std::string& dir);

/// Streams samples into a fresh directory `dir` (which must not exist; the caller renames it into
/// place when done, so that an interrupted run leaves no half-written output). Throws
/// std::runtime_error naming the file on any I/O error.
class PackedWriter {
 public:
  explicit PackedWriter(const std::string& dir);
  ~PackedWriter();
  PackedWriter(const PackedWriter&) = delete;
  PackedWriter& operator=(const PackedWriter&) = delete;

  void add(const Sample& s);
  /// Writes offsets and manifest.json (given fields plus format, num_samples, num_tokens,
  /// num_loss_tokens), flushes and fsyncs everything.
  void finish(nlohmann::json manifest);

  int64_t num_samples() const { return int64_t(offsets_.size()) - 1; }
  int64_t num_tokens() const { return offsets_.back(); }
  int64_t num_loss_tokens() const { return loss_tokens_; }

 private:
  std::string dir_;
  std::FILE* tokens_ = nullptr;
  std::FILE* mask_ = nullptr;
  std::vector<int64_t> offsets_{0};
  int64_t loss_tokens_ = 0;
};

/// Read access to a packed directory, memory-mapped and validated at open (sizes agree with each
/// other and with the manifest, offsets non-decreasing). Thread-safe reads.
class PackedDataset {
 public:
  /// Throws std::runtime_error naming the file and what is inconsistent.
  explicit PackedDataset(const std::string& dir);
  int64_t num_samples() const { return int64_t(offsets_.size()) - 1; }
  int64_t num_tokens() const { return offsets_.empty() ? 0 : offsets_.back(); }
  std::span<const int32_t> ids(int64_t i) const;
  std::span<const uint8_t> loss_mask(int64_t i) const;
  const nlohmann::json& manifest() const { return manifest_; }

 private:
  std::string dir_;
  MappedFile tokens_, mask_;
  std::vector<int64_t> offsets_;
  nlohmann::json manifest_;
};

}  // namespace dflash
