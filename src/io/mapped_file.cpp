#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace dflash {

namespace {

std::string errno_text(int e) { return std::generic_category().message(e); }

/// Closes a descriptor (unless negative) on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

/// Throws "<prefix><what>: <strerror(errno)>".
[[noreturn]] void fail_errno(const std::string& prefix, const char* what) {
  const int e = errno;  // before anything can change it
  throw std::runtime_error(prefix + what + ": " + errno_text(e));
}

/// Opens `path` read-only and checks it is a regular file; returns the descriptor (the caller
/// closes it) and stores the file size. Throws "<prefix>cannot open: ..." etc.
int open_regular(const std::string& path, const std::string& prefix, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno(prefix, "cannot open");
  FdCloser closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_errno(prefix, "cannot stat");
  if (!S_ISREG(st.st_mode)) throw std::runtime_error(prefix + "not a regular file");
  *size = uint64_t(st.st_size);
  closer.fd = -1;  // success: the caller owns the descriptor now
  return fd;
}

}  // namespace

MappedFile::MappedFile(const std::string& path) : MappedFile(path, path + ": ") {}

MappedFile::MappedFile(const std::string& path, const std::string& error_prefix) : path_(path) {
  uint64_t size = 0;
  const FdCloser fd{open_regular(path, error_prefix, &size)};
  if (size > uint64_t(std::numeric_limits<std::size_t>::max()))
    throw std::runtime_error(error_prefix + "file too large to map");
  if (size == 0) return;  // mmap rejects length 0; an empty file maps nothing
  void* m = ::mmap(nullptr, std::size_t(size), PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (m == MAP_FAILED) fail_errno(error_prefix, "mmap failed");
  data_ = static_cast<const unsigned char*>(m);
  size_ = std::size_t(size);
}

MappedFile::~MappedFile() { release(); }

void MappedFile::release() noexcept {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

std::string read_small_file(const std::string& path, uint64_t max_bytes) {
  const std::string prefix = path + ": ";
  uint64_t size = 0;
  const FdCloser fd{open_regular(path, prefix, &size)};
  if (size > max_bytes)
    throw std::runtime_error(prefix + "file is " + std::to_string(size) +
                             " bytes, more than the limit of " + std::to_string(max_bytes));
  std::string out(std::size_t(size), '\0');
  std::size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::read(fd.fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail_errno(prefix, "read failed");
    if (n == 0) break;  // file shrank
    got += std::size_t(n);
  }
  out.resize(got);
  return out;
}

}  // namespace dflash
