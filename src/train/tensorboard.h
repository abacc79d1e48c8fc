// TensorBoard event files (events.out.tfevents.*): scalar summaries that `tensorboard --logdir`
// reads. Format: TFRecord framing (uint64 length, masked CRC-32C of the length, the bytes, masked
// CRC-32C of the bytes) around tensorflow.Event protocol buffers (event.proto / summary.proto:
// Event{wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5},
// Summary{value = 1}, Summary.Value{tag = 1 (string), simple_value = 2 (float)}).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dflash {

/// CRC-32C (Castagnoli) of `n` bytes, and TFRecord's masked form ((crc >> 15 | crc << 17) + 0xa282ead8).
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  /// Creates `dir` (if needed) and a fresh events.out.tfevents.<seconds>.<host>.<pid> file in it,
  /// starting with the file_version event. Throws std::runtime_error naming the path.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// One event with the given scalars at `step`, flushed to disk. Throws std::runtime_error on I/O errors.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& bytes);
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace dflash
