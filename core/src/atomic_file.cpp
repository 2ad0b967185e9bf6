#include "shardema/core/atomic_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>
#include <utility>

#include "os_error.h"
#include "shardema/core/regular_file.h"

namespace shardema {
namespace {

// Thread-safe strerror.
using detail::osError;

// One write() may move at most about 2 GiB on Linux; larger buffers loop.
constexpr size_t kMaxWriteChunk = size_t{1} << 30;

std::string parentFolder(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Without this the rename itself may be lost in a crash even though the
// file's data reached the disk.
void fsyncFolder(const std::string& folder, const std::string& path) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, path, ": cannot open folder ", folder, " to fsync it: ", osError(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, path, ": fsync of folder ", folder, " failed: ", osError(error));
}

// The rename at commit() replaces whatever has the final name: a device
// node, a FIFO or a folder there is refused instead (run as root against
// /dev/full, a writer once replaced the device node).
void refuseNonRegularTarget(const std::string& path, const std::string& what) {
  const std::string kind = detail::nonRegularKindAt(path);
  TORCH_CHECK_VALUE(kind.empty(), path, ": ", what, " exists and is ", kind,
                    ", not a regular file; refusing to replace it (remove it or choose another "
                    "name)");
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path)
    : path_(std::move(path)), tmpPath_(path_ + ".tmp") {
  TORCH_CHECK(!path_.empty(), "AtomicFileWriter: empty path");
  refuseNonRegularTarget(path_, "the output");
  // A leftover temp file of a crashed write is replaced; anything else with
  // that name (a FIFO would block this open) is refused.
  refuseNonRegularTarget(tmpPath_, "the temporary file");
  fd_ = ::open(tmpPath_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  TORCH_CHECK(fd_ >= 0, path_, ": cannot create ", tmpPath_, ": ", osError(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  // Best effort: a destructor cannot report, and the old file is intact.
  if (!committed_ && !tmpPath_.empty()) ::unlink(tmpPath_.c_str());
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tmpPath_(std::exchange(other.tmpPath_, std::string())),
      fd_(std::exchange(other.fd_, -1)),
      written_(other.written_),
      finished_(other.finished_),
      committed_(other.committed_) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    AtomicFileWriter discarded(std::move(*this));
    path_ = std::move(other.path_);
    tmpPath_ = std::exchange(other.tmpPath_, std::string());
    fd_ = std::exchange(other.fd_, -1);
    written_ = other.written_;
    finished_ = other.finished_;
    committed_ = other.committed_;
  }
  return *this;
}

void AtomicFileWriter::write(const void* data, size_t size) {
  TORCH_CHECK(fd_ >= 0, path_, ": write after finish, commit or move");
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, bytes, std::min(size, kMaxWriteChunk));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, path_, ": write to ", tmpPath_, " failed after ", written_,
                " bytes: ", n < 0 ? osError(errno) : std::string("wrote nothing"));
    bytes += n;
    size -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
}

void AtomicFileWriter::overwrite(uint64_t offset, const void* data, size_t size) {
  TORCH_CHECK(fd_ >= 0, path_, ": overwrite after finish, commit or move");
  TORCH_CHECK(offset <= written_ && size <= written_ - offset, path_, ": overwrite of ", size,
              " bytes at ", offset, " goes past the ", written_, " bytes written");
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n =
        ::pwrite(fd_, bytes, std::min(size, kMaxWriteChunk), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, path_, ": overwrite in ", tmpPath_, " at byte ", offset,
                " failed: ", n < 0 ? osError(errno) : std::string("wrote nothing"));
    bytes += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void AtomicFileWriter::finish() {
  TORCH_CHECK(fd_ >= 0 && !finished_, path_, ": finish called twice, after commit or a move");
  TORCH_CHECK(::fsync(fd_) == 0, path_, ": fsync of ", tmpPath_, " failed: ", osError(errno));
  const int rc = ::close(fd_);
  fd_ = -1;
  finished_ = true;
  TORCH_CHECK(rc == 0, path_, ": close of ", tmpPath_, " failed: ", osError(errno));
}

void AtomicFileWriter::commit() {
  TORCH_CHECK((fd_ >= 0 || finished_) && !committed_ && !tmpPath_.empty(), path_,
              ": commit called twice or after a move");
  if (!finished_) finish();
  refuseNonRegularTarget(path_, "the output");  // it may have appeared since the constructor
  TORCH_CHECK(::rename(tmpPath_.c_str(), path_.c_str()) == 0, path_, ": rename of ", tmpPath_,
              " failed: ", osError(errno));
  // The temp name is gone now: the destructor must not unlink it.
  committed_ = true;
  fsyncFolder(parentFolder(path_), path_);
}

void syncFolder(const std::string& folder) { fsyncFolder(folder, folder); }

void writeFileAtomically(const std::string& path, const void* data, size_t size) {
  AtomicFileWriter writer(path);
  writer.write(data, size);
  writer.commit();
}

}  // namespace shardema
