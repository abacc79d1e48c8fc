// Reading and writing the safetensors format (https://huggingface.co/docs/safetensors):
//   [u64 little-endian header length N][N bytes of JSON header][data section]
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data section) plus an optional "__metadata__" object of strings.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/mapped_file.h"
#include "io/weights.h"
#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace dflash {

/// One .safetensors file, memory-mapped read-only and fully validated on open.
///
/// Validation: file >= 8 bytes; header length <= 100 MiB and <= file size - 8; header is a JSON
/// object (nested at most 3 levels, no duplicate tensor names); every entry has a known dtype
/// string, a shape of non-negative integers (rank <= 64), data_offsets [begin, end] with
/// begin <= end <= data section size and end - begin == product(shape) x dtype size (overflow
/// checked); no two tensors share bytes; "__metadata__", when present, is an object of strings.
/// Every failure throws std::runtime_error naming the file path (and the tensor, when one is at
/// fault). Hostile input never causes allocations larger than the file itself.
///
/// Tensor bytes are not copied: data() points into the mapping, which lives as long as the object.
/// The pointer may be unaligned (the header length is arbitrary); read through memcpy or
/// convert_to_f32. The file must not be truncated while mapped. Non-copyable, movable; all const
/// members are safe to call from several threads.
class SafetensorsFile {
 public:
  /// Opens and validates `path`. Throws std::runtime_error naming the path on any problem.
  explicit SafetensorsFile(const std::string& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  SafetensorsFile(SafetensorsFile&& other) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept = default;

  /// All tensors, in order of their data offsets. TensorInfo::file is the path.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const;
  /// First byte of the tensor's data (nbytes(name) bytes, possibly unaligned). Throws if absent.
  const void* data(const std::string& name) const;
  /// Size in bytes of the tensor's data. Throws if absent.
  std::size_t nbytes(const std::string& name) const;
  /// The "__metadata__" object (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Path as given to the constructor.
  const std::string& path() const { return file_.path(); }

 private:
  struct Range {
    uint64_t begin = 0, end = 0;  // relative to the data section
  };
  std::size_t index_of(const std::string& name) const;  // throws if absent
  void parse_header(const char* header, std::size_t header_len, uint64_t data_size);

  MappedFile file_;                     // the whole file
  std::size_t data_start_ = 0;          // 8 + header length
  std::vector<TensorInfo> tensors_;
  std::vector<Range> ranges_;           // parallel to tensors_
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/// A safetensors checkpoint: one file or a sharded set described by model.safetensors.index.json.
/// All tensors of all shards are visible; reads are thread-safe (everything is const after open).
class SafetensorsCheckpoint : public WeightSource {
 public:
  /// `path` is one of:
  ///  - a directory holding model.safetensors.index.json ({"weight_map": {tensor: shard file}});
  ///    shard names must be plain file names in that directory (no "/", no ".."), and every
  ///    tensor listed must exist in the shard it is mapped to;
  ///  - a directory holding model.safetensors;
  ///  - a path to a *.index.json file (as above) or to a single .safetensors file.
  /// A tensor name found in two shards is an error. Throws std::runtime_error naming the path
  /// (the index file for index problems, the shard for shard problems).
  static std::unique_ptr<SafetensorsCheckpoint> open(const std::string& path);

  std::vector<std::string> names() const override;
  bool has(const std::string& name) const override;
  TensorInfo info(const std::string& name) const override;
  /// Converts F32/F16/BF16/F64 and integer/bool tensors to float32.
  Tensor load_f32(const std::string& name) const override;
  std::string origin() const override { return origin_; }

  /// The shard files, in the order they were opened.
  const std::vector<SafetensorsFile>& shards() const { return shards_; }

 private:
  SafetensorsCheckpoint() = default;
  void add_shard(SafetensorsFile file);
  const SafetensorsFile& shard_of(const std::string& name) const;  // throws if absent

  std::string origin_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, std::size_t> where_;  // tensor name -> index into shards_ (sorted)
};

/// One tensor to write: `data` holds product(shape) x dtype_size(dtype) bytes (may be null when
/// that is zero).
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

/// Writes a .safetensors file: header JSON padded with spaces to a multiple of 8 bytes, data in
/// entry order, contiguous. Atomic: writes `path + ".tmp.<pid>"`, fsyncs, renames over `path`;
/// on failure the temp file is removed. Throws std::runtime_error naming the path (and the
/// tensor) for I/O errors, empty/duplicate/reserved names, negative dimensions or null data.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

/// Convenience: writes float32 host tensors (in the given order) as F32.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, const Tensor*>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dflash
