// Reading GGUF files (llama.cpp / ggml model container) and dequantizing their tensors to float32
// (a `llama` GGUF model under Hugging Face names: models/gguf_llama.h).
//
// Format (ggml docs/gguf.md, versions 2 and 3; all integers little-endian):
//   u32 magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//   kv_count x { string key | u32 value_type | value }
//   tensor_count x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
//   padding to general.alignment (default 32) | data section (tensor offsets are relative to it)
// where string = { u64 length | bytes } and an array value = { u32 elem_type | u64 count | elems }.
// ne[0] is the innermost (fastest-varying) dimension, so the PyTorch shape is ne reversed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/mapped_file.h"
#include "io/weights.h"
#include "tensor/tensor.h"

namespace dflash {

/// ggml tensor element types (ids as in ggml.h `enum ggml_type`; gaps are removed types).
/// Values outside this list may appear in a (hostile) file; GGUFFile rejects them on open.
enum class GGMLType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

/// Block geometry of a ggml type: `block_size` elements are stored in `type_size` bytes.
struct GGMLTypeTraits {
  const char* name;
  int64_t block_size;
  int64_t type_size;
};
/// Traits of a known type, or nullptr for an unknown id.
const GGMLTypeTraits* ggml_type_traits(GGMLType t);
/// "Q4_K", or "unknown(99)" for an unknown id.
std::string ggml_type_name(GGMLType t);
/// True for the types ggml_dequantize handles: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.
bool ggml_can_dequantize(GGMLType t);

/// Converts `n` elements stored as `type` at `src` (n / block_size blocks, unaligned is fine) to
/// float32 into `dst`, bit-exactly as ggml's reference dequantize_row_* (ggml-quants.c) does:
///   F32/F16/BF16: plain conversion.
///   Q8_0 {f16 d; i8 qs[32]}:                 y = d * qs[i]
///   Q4_0 {f16 d; u8 qs[16]}:                 y[j] = d * (lo(qs[j]) - 8), y[j+16] = d * (hi(qs[j]) - 8)
///   Q4_1 {f16 d; f16 m; u8 qs[16]}:          y[j] = d * lo(qs[j]) + m, y[j+16] = d * hi(qs[j]) + m
///   Q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]} (256 values, 8 sub-blocks of 32 with 6-bit
///        scale sc and min mn packed in `scales`): y = d*sc[s] * q - dmin*mn[s]; each 32-byte slice
///        of qs holds sub-block 2k in its low nibbles and sub-block 2k+1 in its high nibbles.
///   Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} (256 values, 16 sub-blocks of 16):
///        y = d * scales[i/16] * (q6 - 32), q6 = 4 low bits from ql + 2 high bits from qh.
/// Throws std::invalid_argument when the type is not dequantizable or n is not a multiple of
/// the block size (callers add file and tensor names).
void ggml_dequantize(GGMLType type, const void* src, float* dst, int64_t n);

/// GGUF metadata value types (gguf.md `gguf_metadata_value_type`).
enum class GGUFValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

/// One tensor of a GGUF file.
struct GGUFTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // GGUF order: ne[0] innermost; 1..4 entries
  GGMLType type = GGMLType::F32;
  uint64_t offset = 0;      // relative to the data section (a multiple of the alignment)
  uint64_t nbytes = 0;      // (ne[0] / block_size) * type_size * ne[1] * ...
  int64_t numel = 0;

  /// PyTorch-order shape: ne reversed (ne = [576, 49152] -> [49152, 576]).
  std::vector<int64_t> shape() const { return {ne.rbegin(), ne.rend()}; }
  std::string type_name() const { return ggml_type_name(type); }
};

/// A GGUF file (version 2 or 3), memory-mapped read-only and fully validated on open.
///
/// Validation: magic, version in {2, 3}; kv and tensor counts, string lengths and array counts
/// checked against the bytes left (a hostile length never allocates more than the file holds);
/// arrays nest at most 16 deep; bool bytes are 0 or 1; no duplicate keys or tensor names;
/// general.alignment (default 32) is an integer, non-zero power of two; tensors have 1..4 dims,
/// a known ggml type, ne[0] a multiple of the type's block size, no element-count/byte-size
/// overflow, an offset that is a multiple of the alignment, and data inside the file.
/// Every failure throws std::runtime_error naming the path (and the key or tensor at fault).
///
/// Metadata becomes one JSON object: integers stay integers (uint64 as unsigned), float32 values
/// become the shortest decimal that round-trips the float (1e-5f -> 1e-05), strings are raw
/// bytes (not checked for UTF-8), arrays become JSON arrays (nested ones nested).
/// Non-copyable, non-movable; all const members are safe to call from several threads.
class GGUFFile {
 public:
  /// Opens and validates `path`. Throws std::runtime_error naming the path on any problem.
  explicit GGUFFile(const std::string& path);
  GGUFFile(const GGUFFile&) = delete;
  GGUFFile& operator=(const GGUFFile&) = delete;

  const std::string& path() const { return file_.path(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  /// Absolute file offset of the data section.
  uint64_t data_offset() const { return data_start_; }
  uint64_t file_size() const { return file_.size(); }

  /// All metadata as a JSON object {key: value}.
  const nlohmann::json& metadata() const { return metadata_; }
  bool has_key(const std::string& key) const { return metadata_.contains(key); }
  /// Stored type of a key's value. Throws std::runtime_error naming the path and key if absent.
  GGUFValueType metadata_type(const std::string& key) const;
  /// general.architecture, or "" when absent.
  std::string architecture() const;

  /// Tensors in file (tensor-info) order.
  const std::vector<GGUFTensorInfo>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const GGUFTensorInfo* find(const std::string& name) const;
  /// The tensor called `name`; throws std::runtime_error naming the path and tensor if absent.
  const GGUFTensorInfo& tensor(const std::string& name) const;
  /// First byte of a tensor's data (tensor(name).nbytes bytes, aligned to alignment() in the file).
  const unsigned char* data(const std::string& name) const;

  /// The tensor dequantized to float32, shape = reversed ne. Throws std::runtime_error naming the
  /// path, tensor and type for types ggml_can_dequantize rejects, or if the tensor is absent.
  Tensor dequantize(const std::string& name) const;

 private:
  void parse();

  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_start_ = 0;
  nlohmann::json metadata_ = nlohmann::json::object();
  std::unordered_map<std::string, GGUFValueType> metadata_types_;
  std::vector<GGUFTensorInfo> tensors_;
  std::unordered_map<std::string, std::size_t> index_;
};


}  // namespace dflash
