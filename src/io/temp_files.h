// Leftovers of interrupted runs and single-writer locks for output directories.
#pragma once
#include <filesystem>
#include <string>

namespace dflash {

/// Removes the entries of `parent` named `<stem><marker><pid>` (pid all digits; stem = `only_stem`
/// when that is given, else any non-empty stem) whose process no longer exists: temporary files /
/// directories of a run that was killed hard (the atomic writers use "<name>.tmp-<pid>" and
/// "<name>.partial-<pid>"). Returns how many were removed; each is reported on stderr with `who`.
/// Never throws.
int remove_stale_temp(const std::filesystem::path& parent, const std::string& marker, const std::string& who,
                      const std::string& only_stem = "");

/// An exclusive advisory lock (flock) on `dir`/.lock, held while the object lives. Throws
/// std::runtime_error naming the directory when another process holds it.
class DirLock {
 public:
  DirLock(const std::filesystem::path& dir, const std::string& what);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace dflash
