#include "io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <system_error>
#include <unordered_set>

#include "io/json_file.h"

namespace dflash {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // 100 MiB
constexpr uint64_t kMaxIndexBytes = 100ull << 20;
constexpr std::size_t kMaxRank = 64;
constexpr int kMaxHeaderDepth = 3;  // {name: {"shape": [dims]}}
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

std::string errno_text(int e) { return std::generic_category().message(e); }

/// A name from an untrusted file, quoted and made safe to print (control bytes escaped,
/// length capped).
std::string quote(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string r = "'";
  const std::size_t n = std::min<std::size_t>(s.size(), 200);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      r += "\\x";
      r += hex[c >> 4];
      r += hex[c & 15];
    } else {
      r += char(c);
    }
  }
  if (s.size() > n) r += "...";
  return r + "'";
}

std::string truncated(const std::string& s, std::size_t max = 300) {
  return s.size() <= max ? s : s.substr(0, max) + "...";
}

/// Reads a non-negative JSON integer that fits in uint64; false for anything else.
bool get_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    const int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = uint64_t(s);
    return true;
  }
  return false;
}

/// product(shape) with overflow and sign checks; false when a dimension is negative or the
/// product does not fit in uint64.
bool checked_numel(const std::vector<int64_t>& shape, uint64_t* out) {
  uint64_t n = 1;
  bool zero = false;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d == 0) zero = true;
  }
  if (zero) {
    *out = 0;
    return true;
  }
  for (int64_t d : shape) {
    const auto u = uint64_t(d);
    if (n > std::numeric_limits<uint64_t>::max() / u) return false;
    n *= u;
  }
  *out = n;
  return true;
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return false;
  *out = a * b;
  return true;
}

std::string offsets_str(uint64_t b, uint64_t e) {
  return "[" + std::to_string(b) + ", " + std::to_string(e) + "]";
}

/// Writes all of [p, p + n); returns 0 or an errno value.
int write_all(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, b, std::min<std::size_t>(n, std::size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;
    b += w;
    n -= std::size_t(w);
  }
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const uint64_t size = file_.size();
  if (size < 8)
    fail(path + ": file is " + std::to_string(size) +
         " bytes, too small for a safetensors file (the header length alone is 8 bytes)");
  const unsigned char* map = file_.data();
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | map[i];
  if (header_len > kMaxHeaderBytes)
    fail(path + ": header length " + std::to_string(header_len) + " exceeds the limit of " +
         std::to_string(kMaxHeaderBytes) + " bytes");
  if (header_len > size - 8)
    fail(path + ": header length " + std::to_string(header_len) + " runs past the end of the " +
         std::to_string(size) + "-byte file");
  data_start_ = std::size_t(8 + header_len);
  parse_header(reinterpret_cast<const char*>(map + 8), std::size_t(header_len),
               size - 8 - header_len);
}

void SafetensorsFile::parse_header(const char* header, std::size_t header_len, uint64_t data_size) {
  // The parser callback bounds the shape of the document while it is being built: no nesting
  // deeper than {name: {field: [values]}}, no arrays longer than kMaxRank inside an entry, and no
  // repeated top-level names (nlohmann would silently keep the last one).
  std::unordered_set<std::string> seen;
  std::string current;  // last top-level key, for messages
  std::size_t count = 0;
  const auto context = [&]() {
    return current.empty() ? std::string() : " (in entry " + quote(current) + ")";
  };
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxHeaderDepth)
          fail(path() + ": header JSON is nested too deeply" + context());
        if (depth == kMaxHeaderDepth - 1) count = 0;
        break;
      case json::parse_event_t::key:
        if (depth == 1) {
          current = parsed.get_ref<const std::string&>();
          if (!seen.insert(current).second)
            fail(path() + ": entry " + quote(current) + " appears twice in the header");
        } else if (depth == kMaxHeaderDepth && ++count > kMaxRank) {
          fail(path() + ": tensor " + quote(current) + ": a field has more than " +
               std::to_string(kMaxRank) + " elements");
        }
        break;
      case json::parse_event_t::value:
        if (depth == kMaxHeaderDepth && ++count > kMaxRank)
          fail(path() + ": tensor " + quote(current) + ": a field has more than " +
               std::to_string(kMaxRank) + " elements (shape rank is limited to " +
               std::to_string(kMaxRank) + ")");
        break;
      default:
        break;
    }
    return true;
  };

  // nlohmann treats a NUL byte as end of input; raw NULs are never valid JSON, so refuse them
  // rather than silently ignoring whatever follows.
  if (std::memchr(header, 0, header_len) != nullptr)
    fail(path() + ": header is not valid JSON: it contains a NUL byte");
  json root;
  try {
    root = json::parse(header, header + header_len, cb);
  } catch (const json::exception& e) {
    fail(path() + ": header is not valid JSON: " + truncated(e.what()));
  }
  if (!root.is_object())
    fail(path() + ": header is not a JSON object (it is " + std::string(root.type_name()) + ")");

  struct Entry {
    TensorInfo info;
    Range range;
  };
  std::vector<Entry> entries;
  entries.reserve(root.size());
  for (const auto& [name, v] : root.items()) {
    if (name == kMetadataKey) {
      if (!v.is_object())
        fail(path() + ": __metadata__ is not a JSON object (it is " + std::string(v.type_name()) + ")");
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string())
          fail(path() + ": __metadata__ value for key " + quote(k) + " is not a string (it is " +
               std::string(mv.type_name()) + ")");
        metadata_.emplace(k, mv.get<std::string>());
      }
      continue;
    }
    const std::string where = path() + ": tensor " + quote(name);
    if (name.empty()) fail(path() + ": a tensor has an empty name");
    if (!v.is_object()) fail(where + ": entry is not a JSON object");

    const auto dt_it = v.find("dtype");
    if (dt_it == v.end()) fail(where + ": missing \"dtype\"");
    if (!dt_it->is_string()) fail(where + ": \"dtype\" is not a string");
    const std::string& dt_name = dt_it->get_ref<const std::string&>();
    const DType dtype = dtype_from_name(dt_name, where);

    const auto sh_it = v.find("shape");
    if (sh_it == v.end()) fail(where + ": missing \"shape\"");
    if (!sh_it->is_array()) fail(where + ": \"shape\" is not an array");
    if (sh_it->size() > kMaxRank)
      fail(where + ": shape has rank " + std::to_string(sh_it->size()) + ", more than " +
           std::to_string(kMaxRank));
    std::vector<int64_t> shape;
    shape.reserve(sh_it->size());
    for (const auto& d : *sh_it) {
      if (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0)
        fail(where + ": shape has a negative dimension " + std::to_string(d.get<int64_t>()));
      uint64_t u = 0;
      if (!get_u64(d, &u)) fail(where + ": shape has a dimension that is not an integer");
      if (u > uint64_t(std::numeric_limits<int64_t>::max()))
        fail(where + ": shape dimension " + std::to_string(u) + " is too large");
      shape.push_back(int64_t(u));
    }

    const auto off_it = v.find("data_offsets");
    if (off_it == v.end()) fail(where + ": missing \"data_offsets\"");
    if (!off_it->is_array() || off_it->size() != 2)
      fail(where + ": \"data_offsets\" is not an array [begin, end]");
    uint64_t begin = 0, end = 0;
    if (!get_u64((*off_it)[0], &begin) || !get_u64((*off_it)[1], &end))
      fail(where + ": \"data_offsets\" must be two non-negative integers");
    if (begin > end)
      fail(where + ": data_offsets " + offsets_str(begin, end) + " have begin > end");
    if (end > data_size)
      fail(where + ": data_offsets " + offsets_str(begin, end) + " run past the end of the " +
           std::to_string(data_size) + "-byte data section");

    uint64_t numel = 0, bytes = 0;
    if (!checked_numel(shape, &numel) || !checked_mul(numel, dtype_size(dtype), &bytes))
      fail(where + ": shape " + shape_str(shape) + " x " + dt_name + " overflows a 64-bit byte count");
    if (end - begin != bytes)
      fail(where + ": data_offsets " + offsets_str(begin, end) + " do not match shape " +
           shape_str(shape) + " x " + dt_name + " = " + std::to_string(bytes) + " bytes");

    Entry e;
    e.info.name = name;
    e.info.dtype = dtype;
    e.info.storage = dt_name;
    e.info.shape = std::move(shape);
    e.info.file = path();
    e.range = {begin, end};
    entries.push_back(std::move(e));
  }

  // Order by position in the data section, then check that no two non-empty tensors share bytes.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.range.begin != b.range.begin) return a.range.begin < b.range.begin;
    if (a.range.end != b.range.end) return a.range.end < b.range.end;
    return a.info.name < b.info.name;
  });
  const Entry* furthest = nullptr;  // non-empty entry reaching furthest so far
  for (const Entry& e : entries) {
    if (e.range.begin == e.range.end) continue;
    if (furthest && e.range.begin < furthest->range.end)
      fail(path() + ": tensors " + quote(furthest->info.name) + " " +
           offsets_str(furthest->range.begin, furthest->range.end) + " and " +
           quote(e.info.name) + " " + offsets_str(e.range.begin, e.range.end) + " overlap");
    if (!furthest || e.range.end > furthest->range.end) furthest = &e;
  }

  tensors_.reserve(entries.size());
  ranges_.reserve(entries.size());
  index_.reserve(entries.size());
  for (Entry& e : entries) {
    index_.emplace(e.info.name, tensors_.size());
    ranges_.push_back(e.range);
    tensors_.push_back(std::move(e.info));
  }
}

std::size_t SafetensorsFile::index_of(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) fail(path() + ": no tensor " + quote(name));
  return it->second;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const void* SafetensorsFile::data(const std::string& name) const {
  return file_.data() + data_start_ + ranges_[index_of(name)].begin;
}

std::size_t SafetensorsFile::nbytes(const std::string& name) const {
  const Range& r = ranges_[index_of(name)];
  return std::size_t(r.end - r.begin);
}

// ---------------------------------------------------------------------------------------------
// SafetensorsCheckpoint

namespace {

/// Opens the shards an index file names. `index_path` is used in messages, `dir` holds shards.
void load_index(const std::string& index_path, const std::filesystem::path& dir,
                const std::function<void(SafetensorsFile)>& add) {
  const json root = read_json_file(index_path, kMaxIndexBytes);
  if (!root.is_object()) fail(index_path + ": not a JSON object");
  const auto wm = root.find("weight_map");
  if (wm == root.end()) fail(index_path + ": missing \"weight_map\"");
  if (!wm->is_object()) fail(index_path + ": \"weight_map\" is not a JSON object");
  if (wm->empty()) fail(index_path + ": \"weight_map\" is empty");

  std::map<std::string, std::vector<std::string>> by_shard;  // shard file -> tensors mapped to it
  for (const auto& [tensor, shard_v] : wm->items()) {
    if (!shard_v.is_string())
      fail(index_path + ": weight_map entry for tensor " + quote(tensor) + " is not a string");
    const std::string& shard = shard_v.get_ref<const std::string&>();
    if (shard.empty() || shard.find('/') != std::string::npos ||
        shard.find('\\') != std::string::npos || shard.find("..") != std::string::npos ||
        shard.find('\0') != std::string::npos)
      fail(index_path + ": tensor " + quote(tensor) + " maps to shard " + quote(shard) +
           ", which is not a plain file name in " + dir.string());
    by_shard[shard].push_back(tensor);
  }

  for (const auto& [shard, tensors] : by_shard) {
    const std::filesystem::path shard_path = dir / shard;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(shard_path, ec))
      fail(index_path + ": shard " + quote(shard) + " (holding tensor " + quote(tensors.front()) +
           ") is missing: " + shard_path.string() + " is not a file");
    SafetensorsFile file(shard_path.string());
    for (const std::string& t : tensors)
      if (!file.find(t))
        fail(index_path + ": tensor " + quote(t) + " is mapped to shard " + quote(shard) +
             ", which does not contain it");
    add(std::move(file));
  }
}

}  // namespace

std::unique_ptr<SafetensorsCheckpoint> SafetensorsCheckpoint::open(const std::string& path) {
  namespace fs = std::filesystem;
  std::unique_ptr<SafetensorsCheckpoint> ck(new SafetensorsCheckpoint());
  ck->origin_ = path;
  const auto add = [&](SafetensorsFile f) { ck->add_shard(std::move(f)); };

  std::error_code ec;
  const fs::path p(path);
  const fs::file_status st = fs::status(p, ec);
  if (st.type() == fs::file_type::not_found) fail(path + ": no such file or directory");
  if (ec) fail(path + ": " + ec.message());

  if (fs::is_directory(st)) {
    const fs::path index = p / kIndexName;
    const fs::path single = p / kSingleName;
    if (fs::exists(index, ec)) {
      load_index(index.string(), p, add);
    } else if (fs::exists(single, ec)) {
      add(SafetensorsFile(single.string()));
    } else {
      fail(path + ": directory has neither " + std::string(kIndexName) + " nor " + kSingleName);
    }
  } else if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
    load_index(path, dir, add);
  } else {
    add(SafetensorsFile(path));
  }
  return ck;
}

void SafetensorsCheckpoint::add_shard(SafetensorsFile file) {
  const std::size_t idx = shards_.size();
  for (const TensorInfo& t : file.tensors()) {
    const auto [it, inserted] = where_.emplace(t.name, idx);
    if (!inserted)
      fail(origin_ + ": tensor " + quote(t.name) + " is in two shards: " +
           shards_[it->second].path() + " and " + file.path());
  }
  shards_.push_back(std::move(file));
}

const SafetensorsFile& SafetensorsCheckpoint::shard_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) fail(origin_ + ": no tensor " + quote(name));
  return shards_[it->second];
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> r;
  r.reserve(where_.size());
  for (const auto& [name, idx] : where_) r.push_back(name);
  return r;
}

bool SafetensorsCheckpoint::has(const std::string& name) const { return where_.count(name) != 0; }

TensorInfo SafetensorsCheckpoint::info(const std::string& name) const {
  return *shard_of(name).find(name);
}

Tensor SafetensorsCheckpoint::load_f32(const std::string& name) const {
  const SafetensorsFile& f = shard_of(name);
  const TensorInfo& ti = *f.find(name);
  const std::size_t nbytes = f.nbytes(name);
  const std::size_t numel = nbytes / dtype_size(ti.dtype);  // validated: nbytes = numel x size
  Tensor t;
  t.shape = ti.shape;
  if (numel == 0) return t;  // a zero dimension (other dimensions may be huge)
  t.data.resize(numel);
  try {
    convert_to_f32(ti.dtype, f.data(name), t.ptr(), numel);
  } catch (const std::exception& e) {
    fail(f.path() + ": tensor " + quote(name) + ": " + e.what());
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Writing

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header[kMetadataKey] = std::move(m);
  }
  std::unordered_set<std::string> seen;
  std::vector<uint64_t> sizes;
  sizes.reserve(entries.size());
  uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    const std::string where = path + ": tensor " + quote(e.name);
    if (e.name.empty()) fail(path + ": cannot write a tensor with an empty name");
    if (e.name == kMetadataKey) fail(where + ": the name is reserved");
    if (!seen.insert(e.name).second) fail(where + ": name given twice");
    uint64_t numel = 0, bytes = 0;
    if (!checked_numel(e.shape, &numel) || !checked_mul(numel, dtype_size(e.dtype), &bytes) ||
        offset + bytes < offset)
      fail(where + ": invalid shape " + shape_str(e.shape));
    if (bytes > 0 && e.data == nullptr) fail(where + ": data is null");
    header[e.name] = {{"dtype", dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", nlohmann::ordered_json::array({offset, offset + bytes})}};
    offset += bytes;
    sizes.push_back(bytes);
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail(path + ": cannot encode the header: " + truncated(e.what()));
  }
  while (text.size() % 8 != 0) text += ' ';
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(uint64_t(text.size()) >> (8 * i));

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) fail(path + ": cannot create " + tmp + ": " + errno_text(errno));
  try {
    const auto check = [&](int err, const char* what) {
      if (err != 0) fail(path + ": " + what + " " + tmp + " failed: " + errno_text(err));
    };
    check(write_all(fd, prefix, 8), "writing");
    check(write_all(fd, text.data(), text.size()), "writing");
    for (std::size_t i = 0; i < entries.size(); ++i)
      if (sizes[i] > 0) check(write_all(fd, entries[i].data, std::size_t(sizes[i])), "writing");
    check(::fsync(fd) == 0 ? 0 : errno, "fsync of");
    const int rc = ::close(fd);
    fd = -1;
    check(rc == 0 ? 0 : errno, "closing");
    check(::rename(tmp.c_str(), path.c_str()) == 0 ? 0 : errno, "renaming");
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename durable (best effort: some file systems refuse fsync on directories).
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const int dfd = ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, const Tensor*>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (t == nullptr) fail(path + ": tensor " + quote(name) + " is null");
    uint64_t numel = 0;
    if (!checked_numel(t->shape, &numel) || numel != uint64_t(t->data.size()))
      fail(path + ": tensor " + quote(name) + ": shape " + shape_str(t->shape) +
           " does not match its " + std::to_string(t->data.size()) + " values");
    entries.push_back({name, DType::F32, t->shape, t->data.data()});
  }
  write_safetensors(path, entries, metadata);
}

}  // namespace dflash
