#pragma once
// The safetensors container, without tensors: building and validating the
// header. Layout (DESIGN.md section 5): 8-byte little-endian header length N,
// N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, ...,
// "__metadata__": {string: string}}, then the data area; offsets are
// relative to the data area. No torch dependency.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shardema/core/tensor_dtype.h"

namespace shardema {

/// One tensor's entry in the header.
struct TensorEntry {
  std::string name;
  FileDType dtype = FileDType::kF32;
  std::vector<int64_t> shape;
  /// [begin, end) byte offsets in the data area.
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t byteSize() const { return end - begin; }
  int64_t numel() const;
};

/// A validated header.
struct SafetensorsHeader {
  /// Entries sorted by (begin, end) offset, the data-area order; ties (empty
  /// tensors at one offset) keep their order in the JSON text.
  std::vector<TensorEntry> tensors;
  /// The __metadata__ map (empty if absent).
  std::map<std::string, std::string> metadata;
  /// Absolute offset of the data area in the file: 8 + N.
  uint64_t dataOffset = 0;
  /// Total size of the data area in bytes (file size - dataOffset).
  uint64_t dataSize = 0;

  /// Entry by name, or nullptr.
  const TensorEntry* find(const std::string& name) const;
};

/// Upper bound on N we accept (100 MiB, as the safetensors reference does):
/// a larger header is treated as corrupt before any allocation.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;
/// Deepest JSON nesting we accept; a valid header needs 3 levels.
constexpr int kMaxSafetensorsJsonDepth = 64;

/// Validates and parses a header. `prefix` holds the first bytes of the file
/// (at least 8 + N of them when the header is complete), `fileSize` is the
/// size of the whole file, `source` names the file in error messages.
/// Checks: N against the file size and kMaxSafetensorsHeaderBytes; JSON
/// well-formed and an object; known dtype names; shapes of non-negative
/// integers; shape x dtype size == end - begin (no overflow); offsets
/// ordered, inside the data area, non-overlapping, covering it without
/// holes; no duplicate names (at any level); non-empty names; metadata
/// values strings; JSON nesting at most kMaxSafetensorsJsonDepth. Unknown
/// fields in a tensor entry are ignored, as the reference does. Throws
/// c10::ValueError "<source>: <what is wrong>" on the first violation.
SafetensorsHeader parseSafetensorsHeader(const uint8_t* prefix, size_t prefixSize,
                                         uint64_t fileSize, const std::string& source);

/// Reads the 8-byte length prefix; c10::ValueError if prefixSize < 8.
uint64_t readSafetensorsHeaderLength(const uint8_t* prefix, size_t prefixSize,
                                     const std::string& source);

/// Reads the length prefix N and checks it against the file size and
/// kMaxSafetensorsHeaderBytes, so a reader can size its header buffer from
/// it safely. c10::ValueError "<source>: ..." on a short or corrupt prefix.
uint64_t checkedSafetensorsHeaderLength(const uint8_t* prefix, size_t prefixSize, uint64_t fileSize,
                                        const std::string& source);

/// Builds the on-disk header bytes (length prefix + JSON, padded with spaces
/// to a multiple of 8 so the data area is 8-byte aligned) for entries laid
/// out back to back in the given order; assigns begin/end in `entries`.
/// Names must be unique, non-empty, valid UTF-8 and must not be
/// "__metadata__"; shapes non-negative (c10::ValueError "<source>: ..."
/// naming the tensor). `source` names the file being written.
std::string buildSafetensorsHeader(std::vector<TensorEntry>& entries,
                                   const std::map<std::string, std::string>& metadata,
                                   const std::string& source = "buildSafetensorsHeader");

}  // namespace shardema
