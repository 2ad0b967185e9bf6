#pragma once
// AtomicFileWriter: crash-safe replacement of a file. Bytes go to
// "<path>.tmp"; commit() fsyncs it, renames it over <path> and fsyncs the
// folder. Until commit() the old file (if any) is untouched; a writer
// destroyed without commit() removes the temp file.
#include <cstddef>
#include <cstdint>
#include <string>

namespace shardema {

class AtomicFileWriter {
 public:
  /// Creates/truncates "<path>.tmp". c10::Error naming the path on failure.
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  /// Moves take over the temp file; the moved-from writer owns nothing.
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;

  /// Appends bytes (blocking, handles short writes and EINTR). c10::Error
  /// naming the path and the OS error (disk full, ...) on failure.
  void write(const void* data, size_t size);
  /// Replaces bytes already written (a header completed once the data
  /// behind it is known); the size does not change. c10::Error naming the
  /// path for a range past what was written or an OS error.
  void overwrite(uint64_t offset, const void* data, size_t size);
  /// Bytes written so far.
  uint64_t size() const { return written_; }
  /// fsync and close the temp file, leaving it under its temp name: the
  /// data is durable and no descriptor is held, but <path> is untouched
  /// until commit(), which then only renames. For a set of files published
  /// together (TensorFolderWriter). Once only; no write after it.
  void finish();
  /// fsync (unless finish() did), rename over the final path, fsync the
  /// folder. Once only. On failure before the rename the old file is
  /// untouched and the temp file is removed by the destructor.
  void commit();

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string tmpPath_;
  int fd_ = -1;
  uint64_t written_ = 0;
  bool finished_ = false;
  bool committed_ = false;
};

/// Writes `size` bytes to path atomically (AtomicFileWriter in one call).
void writeFileAtomically(const std::string& path, const void* data, size_t size);

/// fsyncs folder `folder`, so the renames and removals made in it survive a
/// crash. c10::Error naming the folder on failure.
void syncFolder(const std::string& folder);

}  // namespace shardema
