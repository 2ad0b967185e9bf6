#pragma once
// RegularFile: the one way shardema opens a file it reads. The path is
// opened without blocking and refused unless it is a regular file, before
// any read: a plain open() of a FIFO blocks until a writer appears, so a
// `mkfifo x.safetensors` would hang every reader. Folders, devices and
// sockets are refused the same way. Owns the descriptor; not copyable.
#include <cstdint>
#include <string>

namespace shardema::detail {

class RegularFile {
 public:
  /// c10::ValueError naming the path (and `what` it was meant to be, e.g.
  /// "safetensors file", "manifest") when it cannot be opened or stat'ed or
  /// is not a regular file.
  RegularFile(const std::string& path, const char* what);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;

  int fd() const { return fd_; }
  /// Size when opened.
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

/// What occupies `path` when it is something other than a regular file ("a
/// FIFO", "a folder", "a device", "a socket", "a symbolic link"), judged
/// without following a link; "" when nothing is there or it is a regular
/// file. Writers refuse to replace such a thing.
std::string nonRegularKindAt(const std::string& path);

/// The whole of a small regular file (a manifest, a JSON sidecar). A file
/// larger than maxBytes is refused before anything is read or allocated
/// (c10::ValueError naming the file, its size and the bound), so a hostile
/// file cannot make us allocate its size.
std::string readSmallRegularFile(const std::string& path, const char* what, uint64_t maxBytes);

}  // namespace shardema::detail
