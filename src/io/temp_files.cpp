#include "io/temp_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace dflash {

namespace fs = std::filesystem;

int remove_stale_temp(const fs::path& parent, const std::string& marker, const std::string& who,
                      const std::string& only_stem) {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(parent.empty() ? fs::path(".") : parent, ec)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.rfind(marker);
    if (at == std::string::npos || at == 0 || (!only_stem.empty() && name.substr(0, at) != only_stem)) continue;
    const std::string pid = name.substr(at + marker.size());
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    if (::kill(pid_t(std::stol(pid)), 0) != 0 && errno == ESRCH) {
      std::fprintf(stderr, "%s: removing %s left by an interrupted run\n", who.c_str(), e.path().c_str());
      fs::remove_all(e.path(), ec);
      removed += !ec;
    }
  }
  return removed;
}

DirLock::DirLock(const fs::path& dir, const std::string& what) {
  const std::string p = (dir / ".lock").string();
  fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("cannot create " + p + ": " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error(dir.string() + " is in use by another " + what + " (lock " + p + ")");
  }
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace dflash
