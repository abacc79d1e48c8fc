// GGUF container parsing (see gguf.h for the layout and the checks made).
#include "io/gguf.h"

#include <bit>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

namespace dflash {

namespace {

constexpr uint32_t kMaxDims = 4;
constexpr int kMaxArrayDepth = 16;

/// Bounds-checked little-endian cursor over the mapped file.
class Reader {
 public:
  Reader(const unsigned char* data, std::size_t size, const std::string& path)
      : p_(data), size_(size), path_(path) {}

  std::size_t pos() const { return pos_; }
  std::size_t left() const { return size_ - pos_; }

  [[noreturn]] void fail(const std::string& msg) const {
    throw std::runtime_error(fmt::format("GGUF file '{}': {}", path_, msg));
  }
  void need(std::size_t n, const char* what) const {
    if (n > left())
      fail(fmt::format("truncated while reading {} (need {} bytes at offset {}, file has {})", what,
                       n, pos_, size_));
  }
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));  // host is little-endian (checked below)
    pos_ += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const uint64_t n = get<uint64_t>(what);
    if (n > left())
      fail(fmt::format("{} has length {} but only {} bytes are left (offset {})", what, n, left(),
                       pos_));
    std::string s(reinterpret_cast<const char*>(p_ + pos_), std::size_t(n));
    pos_ += std::size_t(n);
    return s;
  }

 private:
  const unsigned char* p_;
  std::size_t size_;
  std::size_t pos_ = 0;
  const std::string& path_;
};

static_assert(std::endian::native == std::endian::little, "GGUF reader assumes a little-endian host");

/// Smallest encoded size of one value of type `t` (for bounding counts by the bytes left).
std::size_t min_value_size(GGUFValueType t) {
  switch (t) {
    case GGUFValueType::UINT8: case GGUFValueType::INT8: case GGUFValueType::BOOL: return 1;
    case GGUFValueType::UINT16: case GGUFValueType::INT16: return 2;
    case GGUFValueType::UINT32: case GGUFValueType::INT32: case GGUFValueType::FLOAT32: return 4;
    case GGUFValueType::UINT64: case GGUFValueType::INT64: case GGUFValueType::FLOAT64: return 8;
    case GGUFValueType::STRING: return 8;
    case GGUFValueType::ARRAY: return 12;
  }
  return 0;
}

bool known_value_type(uint32_t t) { return t <= uint32_t(GGUFValueType::FLOAT64); }

/// float32 -> the double of its shortest round-trip decimal (1e-5f -> 1e-05, not 9.99999974e-06).
double float_to_json_double(float f) {
  if (!std::isfinite(f)) return double(f);
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf) - 1, f);
  *r.ptr = '\0';
  return std::strtod(buf, nullptr);
}

nlohmann::json read_value(Reader& r, GGUFValueType t, const std::string& key, int depth);

nlohmann::json read_array(Reader& r, const std::string& key, int depth) {
  if (depth >= kMaxArrayDepth)
    r.fail(fmt::format("metadata key '{}': arrays nested deeper than {}", key, kMaxArrayDepth));
  const uint32_t et = r.get<uint32_t>("array element type");
  if (!known_value_type(et))
    r.fail(fmt::format("metadata key '{}': unknown array element type {}", key, et));
  const auto etype = GGUFValueType(et);
  const uint64_t n = r.get<uint64_t>("array length");
  if (n > r.left() / min_value_size(etype))
    r.fail(fmt::format("metadata key '{}': array of {} elements does not fit in the {} bytes left",
                       key, n, r.left()));
  nlohmann::json arr = nlohmann::json::array();
  auto& vec = arr.get_ref<nlohmann::json::array_t&>();
  vec.reserve(std::size_t(n));
  for (uint64_t i = 0; i < n; ++i) vec.push_back(read_value(r, etype, key, depth + 1));
  return arr;
}

nlohmann::json read_value(Reader& r, GGUFValueType t, const std::string& key, int depth) {
  switch (t) {
    case GGUFValueType::UINT8: return r.get<uint8_t>("uint8 value");
    case GGUFValueType::INT8: return r.get<int8_t>("int8 value");
    case GGUFValueType::UINT16: return r.get<uint16_t>("uint16 value");
    case GGUFValueType::INT16: return r.get<int16_t>("int16 value");
    case GGUFValueType::UINT32: return r.get<uint32_t>("uint32 value");
    case GGUFValueType::INT32: return r.get<int32_t>("int32 value");
    case GGUFValueType::UINT64: return r.get<uint64_t>("uint64 value");
    case GGUFValueType::INT64: return r.get<int64_t>("int64 value");
    case GGUFValueType::FLOAT32: return float_to_json_double(r.get<float>("float32 value"));
    case GGUFValueType::FLOAT64: return r.get<double>("float64 value");
    case GGUFValueType::BOOL: {
      const uint8_t b = r.get<uint8_t>("bool value");
      if (b > 1) r.fail(fmt::format("metadata key '{}': bool byte is {} (must be 0 or 1)", key, b));
      return b == 1;
    }
    case GGUFValueType::STRING: return r.str("string value");
    case GGUFValueType::ARRAY: return read_array(r, key, depth);
  }
  r.fail(fmt::format("metadata key '{}': unknown value type {}", key, uint32_t(t)));
}

bool mul_ok(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// ggml type table (block sizes and bytes per block from ggml-common.h).

const GGMLTypeTraits* ggml_type_traits(GGMLType t) {
  static const GGMLTypeTraits kF32{"F32", 1, 4}, kF16{"F16", 1, 2}, kQ4_0{"Q4_0", 32, 18},
      kQ4_1{"Q4_1", 32, 20}, kQ5_0{"Q5_0", 32, 22}, kQ5_1{"Q5_1", 32, 24}, kQ8_0{"Q8_0", 32, 34},
      kQ8_1{"Q8_1", 32, 36}, kQ2_K{"Q2_K", 256, 84}, kQ3_K{"Q3_K", 256, 110},
      kQ4_K{"Q4_K", 256, 144}, kQ5_K{"Q5_K", 256, 176}, kQ6_K{"Q6_K", 256, 210},
      kQ8_K{"Q8_K", 256, 292}, kIQ2_XXS{"IQ2_XXS", 256, 66}, kIQ2_XS{"IQ2_XS", 256, 74},
      kIQ3_XXS{"IQ3_XXS", 256, 98}, kIQ1_S{"IQ1_S", 256, 50}, kIQ4_NL{"IQ4_NL", 32, 18},
      kIQ3_S{"IQ3_S", 256, 110}, kIQ2_S{"IQ2_S", 256, 82}, kIQ4_XS{"IQ4_XS", 256, 136},
      kI8{"I8", 1, 1}, kI16{"I16", 1, 2}, kI32{"I32", 1, 4}, kI64{"I64", 1, 8},
      kF64{"F64", 1, 8}, kIQ1_M{"IQ1_M", 256, 56}, kBF16{"BF16", 1, 2},
      kTQ1_0{"TQ1_0", 256, 54}, kTQ2_0{"TQ2_0", 256, 66}, kMXFP4{"MXFP4", 32, 17};
  switch (t) {
    case GGMLType::F32: return &kF32;
    case GGMLType::F16: return &kF16;
    case GGMLType::Q4_0: return &kQ4_0;
    case GGMLType::Q4_1: return &kQ4_1;
    case GGMLType::Q5_0: return &kQ5_0;
    case GGMLType::Q5_1: return &kQ5_1;
    case GGMLType::Q8_0: return &kQ8_0;
    case GGMLType::Q8_1: return &kQ8_1;
    case GGMLType::Q2_K: return &kQ2_K;
    case GGMLType::Q3_K: return &kQ3_K;
    case GGMLType::Q4_K: return &kQ4_K;
    case GGMLType::Q5_K: return &kQ5_K;
    case GGMLType::Q6_K: return &kQ6_K;
    case GGMLType::Q8_K: return &kQ8_K;
    case GGMLType::IQ2_XXS: return &kIQ2_XXS;
    case GGMLType::IQ2_XS: return &kIQ2_XS;
    case GGMLType::IQ3_XXS: return &kIQ3_XXS;
    case GGMLType::IQ1_S: return &kIQ1_S;
    case GGMLType::IQ4_NL: return &kIQ4_NL;
    case GGMLType::IQ3_S: return &kIQ3_S;
    case GGMLType::IQ2_S: return &kIQ2_S;
    case GGMLType::IQ4_XS: return &kIQ4_XS;
    case GGMLType::I8: return &kI8;
    case GGMLType::I16: return &kI16;
    case GGMLType::I32: return &kI32;
    case GGMLType::I64: return &kI64;
    case GGMLType::F64: return &kF64;
    case GGMLType::IQ1_M: return &kIQ1_M;
    case GGMLType::BF16: return &kBF16;
    case GGMLType::TQ1_0: return &kTQ1_0;
    case GGMLType::TQ2_0: return &kTQ2_0;
    case GGMLType::MXFP4: return &kMXFP4;
  }
  return nullptr;
}

std::string ggml_type_name(GGMLType t) {
  const auto* tr = ggml_type_traits(t);
  return tr ? std::string(tr->name) : fmt::format("unknown({})", uint32_t(t));
}

// ---------------------------------------------------------------------------------------------
// GGUFFile

GGUFFile::GGUFFile(const std::string& path)
    : file_(path, fmt::format("GGUF file '{}': ", path)) {
  if (file_.size() < 24)
    throw std::runtime_error(fmt::format(
        "GGUF file '{}': {} bytes is too small for a GGUF header (24 bytes)", path, file_.size()));
  parse();
}

void GGUFFile::parse() {
  const unsigned char* map = file_.data();
  const std::size_t map_size = file_.size();
  Reader r(map, map_size, file_.path());
  if (std::memcmp(map, "GGUF", 4) != 0)
    r.fail(fmt::format("bad magic (expected \"GGUF\", got bytes {:02x} {:02x} {:02x} {:02x})",
                       map[0], map[1], map[2], map[3]));
  r.get<uint32_t>("magic");
  version_ = r.get<uint32_t>("version");
  if (version_ != 2 && version_ != 3)
    r.fail(fmt::format("unsupported GGUF version {} (supported: 2, 3; big-endian files are not "
                       "supported)",
                       version_));
  const uint64_t n_tensors = r.get<uint64_t>("tensor count");
  const uint64_t n_kv = r.get<uint64_t>("metadata key/value count");
  // Each kv needs >= 13 bytes (key length, type, 1-byte value); each tensor info >= 32 bytes.
  if (n_kv > r.left() / 13)
    r.fail(fmt::format("metadata count {} does not fit in the {} bytes left", n_kv, r.left()));
  if (n_tensors > r.left() / 32)
    r.fail(fmt::format("tensor count {} does not fit in the {} bytes left", n_tensors, r.left()));

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.str("metadata key");
    if (metadata_types_.count(key)) r.fail(fmt::format("duplicate metadata key '{}'", key));
    const uint32_t t = r.get<uint32_t>("metadata value type");
    if (!known_value_type(t)) r.fail(fmt::format("metadata key '{}': unknown value type {}", key, t));
    nlohmann::json v = read_value(r, GGUFValueType(t), key, 0);
    metadata_types_.emplace(key, GGUFValueType(t));
    metadata_.emplace(std::move(key), std::move(v));
  }

  if (auto it = metadata_.find("general.alignment"); it != metadata_.end()) {
    if (!it->is_number_integer())
      r.fail(fmt::format("metadata key 'general.alignment' must be an integer, got {}",
                         it->type_name()));
    const bool neg = it->is_number_integer() && !it->is_number_unsigned() && it->get<int64_t>() < 0;
    const uint64_t a = neg ? 0 : it->get<uint64_t>();
    if (neg || a == 0 || (a & (a - 1)) != 0 || a > (uint64_t(1) << 30))
      r.fail(fmt::format("metadata key 'general.alignment' is {}, must be a non-zero power of two "
                         "(at most 2^30)",
                         it->dump()));
    alignment_ = a;
  }

  tensors_.reserve(std::size_t(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GGUFTensorInfo ti;
    ti.name = r.str("tensor name");
    if (index_.count(ti.name)) r.fail(fmt::format("duplicate tensor name '{}'", ti.name));
    const uint32_t nd = r.get<uint32_t>("tensor n_dims");
    if (nd < 1 || nd > kMaxDims)
      r.fail(fmt::format("tensor '{}': n_dims is {} (must be 1..{})", ti.name, nd, kMaxDims));
    uint64_t numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t ne = r.get<uint64_t>("tensor dimension");
      if (ne > uint64_t(INT64_MAX) || !mul_ok(numel, ne, &numel) || numel > uint64_t(INT64_MAX))
        r.fail(fmt::format("tensor '{}': element count overflows", ti.name));
      ti.ne.push_back(int64_t(ne));
    }
    ti.numel = int64_t(numel);
    const uint32_t type = r.get<uint32_t>("tensor type");
    ti.type = GGMLType(type);
    const GGMLTypeTraits* tr = ggml_type_traits(ti.type);
    if (!tr) r.fail(fmt::format("tensor '{}': unknown ggml type {}", ti.name, type));
    ti.offset = r.get<uint64_t>("tensor offset");
    if (ti.ne[0] % tr->block_size != 0)
      r.fail(fmt::format("tensor '{}': ne[0] = {} is not a multiple of the {} block size {}",
                         ti.name, ti.ne[0], tr->name, tr->block_size));
    uint64_t nbytes = uint64_t(ti.ne[0] / tr->block_size);
    if (!mul_ok(nbytes, uint64_t(tr->type_size), &nbytes))
      r.fail(fmt::format("tensor '{}': byte size overflows", ti.name));
    for (std::size_t d = 1; d < ti.ne.size(); ++d)
      if (!mul_ok(nbytes, uint64_t(ti.ne[d]), &nbytes))
        r.fail(fmt::format("tensor '{}': byte size overflows", ti.name));
    ti.nbytes = nbytes;
    index_.emplace(ti.name, tensors_.size());
    tensors_.push_back(std::move(ti));
  }

  const uint64_t header_end = r.pos();
  data_start_ = (header_end + alignment_ - 1) / alignment_ * alignment_;
  for (const auto& ti : tensors_) {
    if (ti.offset % alignment_ != 0)
      r.fail(fmt::format("tensor '{}': offset {} is not a multiple of the alignment {}", ti.name,
                         ti.offset, alignment_));
    const uint64_t avail = map_size > data_start_ ? map_size - data_start_ : 0;
    if (ti.offset > avail || ti.nbytes > avail - ti.offset)
      r.fail(fmt::format("tensor '{}': data [{}, +{}) lies outside the file (data section starts "
                         "at {}, file has {} bytes)",
                         ti.name, ti.offset, ti.nbytes, data_start_, map_size));
  }
}

GGUFValueType GGUFFile::metadata_type(const std::string& key) const {
  auto it = metadata_types_.find(key);
  if (it == metadata_types_.end())
    throw std::runtime_error(fmt::format("GGUF file '{}': no metadata key '{}'", path(), key));
  return it->second;
}

std::string GGUFFile::architecture() const {
  auto it = metadata_.find("general.architecture");
  return it != metadata_.end() && it->is_string() ? it->get<std::string>() : std::string();
}

const GGUFTensorInfo* GGUFFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const GGUFTensorInfo& GGUFFile::tensor(const std::string& name) const {
  const auto* ti = find(name);
  if (!ti) throw std::runtime_error(fmt::format("GGUF file '{}': no tensor '{}'", path(), name));
  return *ti;
}

const unsigned char* GGUFFile::data(const std::string& name) const {
  return file_.data() + data_start_ + tensor(name).offset;
}

Tensor GGUFFile::dequantize(const std::string& name) const {
  const GGUFTensorInfo& ti = tensor(name);
  if (!ggml_can_dequantize(ti.type))
    throw std::runtime_error(fmt::format(
        "GGUF file '{}': tensor '{}' has ggml type {}, which cannot be dequantized (supported: "
        "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)",
        path(), name, ti.type_name()));
  Tensor out(ti.shape());
  try {
    ggml_dequantize(ti.type, file_.data() + data_start_ + ti.offset, out.ptr(), ti.numel);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        fmt::format("GGUF file '{}': tensor '{}': {}", path(), name, e.what()));
  }
  return out;
}

}  // namespace dflash
