#include "shardema/core/regular_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include "os_error.h"

namespace shardema::detail {
namespace {

const char* kindOf(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

RegularFile::RegularFile(const std::string& path, const char* what) : path_(path) {
  // O_NONBLOCK only matters for the open itself (of a FIFO); it is cleared
  // before any read, and regular files ignore it anyway.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TORCH_CHECK_VALUE(fd_ >= 0, path, ": cannot open the ", what, ": ", osError(errno));
  struct stat info {};
  if (::fstat(fd_, &info) != 0) {
    const int error = errno;
    ::close(fd_);
    TORCH_CHECK_VALUE(false, path, ": cannot stat the ", what, ": ", osError(error));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd_);
    TORCH_CHECK_VALUE(false, path, ": not a regular file (", kindOf(info.st_mode), "), so not a ",
                      what);
  }
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  size_ = static_cast<uint64_t>(info.st_size);
}

RegularFile::~RegularFile() { ::close(fd_); }

std::string nonRegularKindAt(const std::string& path) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0 || S_ISREG(info.st_mode)) return "";
  return kindOf(info.st_mode);
}

std::string readSmallRegularFile(const std::string& path, const char* what, uint64_t maxBytes) {
  RegularFile file(path, what);
  TORCH_CHECK_VALUE(file.size() <= maxBytes, path, ": the ", what, " is ", file.size(),
                    " bytes, more than the ", maxBytes, " a valid one can be");
  std::string text(static_cast<size_t>(file.size()), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(file.fd(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK_VALUE(n >= 0, path, ": read of the ", what, " failed: ", osError(errno));
    TORCH_CHECK_VALUE(n > 0, path, ": the ", what, " shrank while being read");
    done += static_cast<size_t>(n);
  }
  return text;
}

}  // namespace shardema::detail
