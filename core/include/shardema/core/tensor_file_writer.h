#pragma once
// TensorFileWriter: writes a safetensors file tensor by tensor and piece by
// piece, so a file far larger than free memory can be produced (a streaming
// export of gathered shards). The bytes are exactly those writeTensorFile
// would write for the same tensors and metadata (which is written through
// it). Every file carries its per-tensor checksums ("shardema.xxh64",
// tensor_checksums.h): the header goes out with zero digests and is
// completed in place by commit(). Crash-safe: data goes to "<path>.tmp"
// (AtomicFileWriter) and replaces <path> only on commit().
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardema/core/safetensors_header.h"
#include "shardema/core/tensor_checksums.h"

namespace shardema {

class AtomicFileWriter;

/// One tensor of the file to be written, in file (data) order.
struct TensorFileEntry {
  std::string name;
  /// float64/32/16, bfloat16, int64/32/16/8, uint8 or bool.
  at::ScalarType dtype = at::kFloat;
  /// {} for a 0-dim tensor (one element).
  std::vector<int64_t> shape;
};

class TensorFileWriter {
 public:
  /// Validates the entries (unique non-empty names, non-negative dims,
  /// supported dtypes) and the metadata ("shardema.format" is added, and must
  /// be "1" if given), then creates "<path>.tmp" and writes the header.
  /// c10::ValueError / c10::TypeError naming the file and the tensor, or
  /// c10::Error naming the path on an OS error. Blocks.
  TensorFileWriter(const std::string& path, std::vector<TensorFileEntry> entries,
                   const std::map<std::string, std::string>& metadata = {});
  /// Without commit(): the temp file is removed, <path> (old file or none)
  /// is untouched.
  ~TensorFileWriter();
  TensorFileWriter(const TensorFileWriter&) = delete;
  TensorFileWriter& operator=(const TensorFileWriter&) = delete;
  TensorFileWriter(TensorFileWriter&&) noexcept;
  TensorFileWriter& operator=(TensorFileWriter&&) noexcept;

  /// Appends the next flattened (row-major) elements of the current tensor.
  /// `piece`: CPU, contiguous, dtype equal to the entry's, any shape; its
  /// numel may be anything up to what the current tensor still lacks (0 is
  /// a no-op). A piece never spans two tensors: once a tensor is complete,
  /// the next piece starts the next one (empty tensors are skipped
  /// automatically). c10::ValueError naming the file and the tensor for a
  /// wrong dtype, a non-CPU or non-contiguous piece, or too many elements;
  /// a failed append writes nothing. Blocks (one write()).
  void append(const at::Tensor& piece);
  /// Name of the tensor the next piece goes to ("" once all are complete).
  std::string currentTensor() const;
  /// Elements still missing from the current tensor (0 once all complete).
  int64_t remainingInCurrent() const;

  /// Checks every tensor is complete (c10::ValueError naming the first
  /// incomplete one, with counts), completes the header, fsyncs and closes
  /// "<path>.tmp" without renaming it (AtomicFileWriter::finish): for files
  /// published together (TensorFolderWriter). Once only, before commit().
  void finish();
  /// finish() (unless called), then renames over <path> and fsyncs the
  /// folder. Once only.
  void commit();
  /// XXH64 of the whole file as written (header included); only after
  /// commit() (c10::Error otherwise). Equals fileChecksum(path): the first
  /// call reads the file back once, since its header was completed last.
  uint64_t checksum() const;
  /// Total bytes of the file (known from the constructor on).
  uint64_t fileSize() const { return fileSize_; }
  const std::string& path() const { return path_; }

 private:
  void skipCompleteEntries();

  std::string path_;
  std::vector<TensorFileEntry> entries_;
  std::vector<TensorEntry> header_;
  std::map<std::string, std::string> metadata_;
  std::vector<int64_t> numels_;
  std::vector<detail::TensorDigest> digests_;
  std::unique_ptr<AtomicFileWriter> file_;
  size_t current_ = 0;
  int64_t writtenInCurrent_ = 0;
  uint64_t headerSize_ = 0;
  uint64_t fileSize_ = 0;
  mutable std::optional<uint64_t> checksum_;
  bool finished_ = false;
  bool committed_ = false;
};

}  // namespace shardema
