// Read-only access to whole files: a memory mapping (MappedFile) and a plain read of a small file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dflash {

/// A regular file mapped read-only (PROT_READ, MAP_PRIVATE) in full. The descriptor is closed as
/// soon as the mapping exists; the destructor unmaps. A zero-length file maps nothing: data() is
/// nullptr and size() is 0. The file must not be truncated while mapped (reading past its new end
/// raises SIGBUS). Movable (the moved-from object is empty), not copyable.
class MappedFile {
 public:
  /// Opens `path` (O_RDONLY | O_CLOEXEC), requires a regular file and maps it. On failure throws
  /// std::runtime_error "<path>: cannot open: <reason>" (or "cannot stat: <reason>",
  /// "not a regular file", "file too large to map", "mmap failed: <reason>").
  explicit MappedFile(const std::string& path);
  /// As above, with messages "<error_prefix>cannot open: <reason>" etc. instead.
  MappedFile(const std::string& path, const std::string& error_prefix);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;

  /// First byte of the file (nullptr when the file is empty).
  const unsigned char* data() const { return data_; }
  /// Size of the file in bytes when it was opened.
  std::size_t size() const { return size_; }
  /// Path as given to the constructor.
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  std::string path_;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

/// The whole content of the regular file `path`, read with read(2) (a file that shrinks while
/// being read yields what was there). Throws std::runtime_error "<path>: ..." when the file cannot
/// be opened or read, is not a regular file, or is larger than `max_bytes`.
std::string read_small_file(const std::string& path, uint64_t max_bytes);

}  // namespace dflash
