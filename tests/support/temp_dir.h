#pragma once
// A fresh folder under the system temp dir, removed with its contents.
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>

#include <filesystem>
#include <string>

namespace shardema::testing {

/// Removes `path` and everything below it (links are removed, not
/// followed), as `rm -rf`. Not std::filesystem::remove_all: the copy of it
/// that PyPI's torch exports from libtorch.so jumps to address 0, and a
/// test program binds to it when libtorch.so comes before libstdc++ in its
/// DT_NEEDED order (shardema/core/file_system.h).
inline void removeTree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* entry, const struct stat*, int, struct FTW*) {
        ::remove(entry);
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "shardema-test-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data()) ? pattern : std::string();
  }
  ~TempDir() {
    if (!path_.empty()) removeTree(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace shardema::testing
