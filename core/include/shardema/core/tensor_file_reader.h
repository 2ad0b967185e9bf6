#pragma once
// TensorFileReader: random access to a safetensors file without loading it.
// The header is validated once on open (parseSafetensorsHeader: sizes,
// offsets, file length); tensors, or element ranges of them, are then read
// on demand with pread, so memory stays at what is asked for.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardema/core/safetensors_header.h"

namespace shardema {
namespace detail {
class InputFile;
class TensorChecksums;
}  // namespace detail

class TensorFileReader {
 public:
  /// Opens and validates the file (header only, no tensor data).
  /// c10::ValueError naming the file when it is missing, not a regular
  /// file, truncated or corrupt. Blocks.
  explicit TensorFileReader(const std::string& path);
  ~TensorFileReader();
  TensorFileReader(const TensorFileReader&) = delete;
  TensorFileReader& operator=(const TensorFileReader&) = delete;
  TensorFileReader(TensorFileReader&& other) noexcept;
  TensorFileReader& operator=(TensorFileReader&& other) noexcept;

  const std::string& path() const { return path_; }
  /// The validated header (entries in data order, metadata).
  const SafetensorsHeader& header() const { return header_; }
  /// Tensor names in data order.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// Entry by name; c10::IndexError naming the file and tensor when absent.
  const TensorEntry& entry(const std::string& name) const;
  /// The tensor's dtype as an ATen scalar type.
  at::ScalarType scalarType(const std::string& name) const;

  /// Elements [beginElement, beginElement + count) of the row-major
  /// flattened tensor, as a new 1-D CPU tensor of the stored dtype.
  /// c10::IndexError for an unknown name (naming the file); c10::ValueError
  /// for a range outside [0, numel), a negative count, or a read failure
  /// (file shrank, BOOL byte not 0/1). Thread-safe: several threads may
  /// read one reader at once (pread, no shared position). Blocks.
  at::Tensor readRange(const std::string& name, int64_t beginElement, int64_t count) const;
  /// Same, into caller-owned memory: `out` must be a contiguous CPU tensor
  /// of the stored dtype with exactly `count` elements (any shape).
  void readRangeInto(const std::string& name, int64_t beginElement, const at::Tensor& out) const;
  /// The whole tensor in its stored shape and dtype, checked against the
  /// file's checksum of it when the file has them (c10::ValueError naming
  /// the file and the tensor on a mismatch). readRange() cannot check a
  /// part: call verifyChecksums() once for a file read in ranges.
  at::Tensor read(const std::string& name) const;

  /// Whether the file carries per-tensor checksums ("shardema.xxh64";
  /// files from other tools or Python writers may not).
  bool hasChecksums() const;
  /// Reads every tensor once, in bufferBytes pieces (memory stays at that),
  /// and checks each against its checksum: c10::ValueError naming the file
  /// and the first tensor that fails. Nothing to do for a file without
  /// checksums. Blocks.
  void verifyChecksums(int64_t bufferBytes = int64_t{4} << 20) const;

 private:
  std::string path_;
  std::unique_ptr<detail::InputFile> file_;
  SafetensorsHeader header_;
  // Shared (immutable) so the reader stays movable with a forward declaration.
  std::shared_ptr<const detail::TensorChecksums> checksums_;
};

}  // namespace shardema
