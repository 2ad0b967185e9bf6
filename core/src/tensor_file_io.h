#pragma once
// Internal to lib/ core: the pieces shared by writeTensorFile/readTensorFile
// (tensor_file.cpp), TensorFileWriter and TensorFileReader, so the dtype
// mapping, the file checks and the metadata rule exist once.
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "shardema/core/regular_file.h"
#include "shardema/core/safetensors_header.h"

namespace shardema {
namespace detail {

/// ATen's type for a file dtype.
c10::ScalarType toScalarType(FileDType dtype);
/// The file dtype of an ATen type; c10::TypeError naming the file and the
/// tensor for one files cannot hold.
FileDType toFileDType(c10::ScalarType type, const std::string& path, const std::string& name);

/// `metadata` plus "shardema.format" = "1"; c10::ValueError if the caller
/// set that key to anything else.
std::map<std::string, std::string> metadataWithFormat(
    const std::string& path, const std::map<std::string, std::string>& metadata);

/// ATen assumes bool bytes are 0 or 1: c10::ValueError naming the file, the
/// tensor and the element (firstElement + offset) for any other byte.
void checkBoolBytes(const uint8_t* bytes, size_t count, int64_t firstElement,
                    const std::string& path, const std::string& name);

/// Owns a read-only descriptor of a regular file and knows its size.
/// readAt uses pread only, so one InputFile may be read by several threads.
class InputFile {
 public:
  /// c10::ValueError naming the path when it cannot be opened or stat'ed or
  /// is not a regular file (a FIFO is refused without blocking: RegularFile).
  explicit InputFile(const std::string& path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& path() const { return file_.path(); }
  uint64_t size() const { return file_.size(); }
  /// Reads exactly `size` bytes at `offset`; c10::ValueError naming the
  /// file and `what` on an OS error or a short file (truncated).
  void readAt(void* data, size_t size, uint64_t offset, const std::string& what) const;
  /// Reads and validates the header (parseSafetensorsHeader).
  SafetensorsHeader readHeader() const;

 private:
  RegularFile file_;
};

}  // namespace detail
}  // namespace shardema
