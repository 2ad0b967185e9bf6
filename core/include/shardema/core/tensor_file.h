#pragma once
// Reading and writing safetensors files of at::Tensors (DESIGN.md section 5).
// Python users read these with `safetensors` or numpy; nothing is pickled.
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/safetensors_header.h"

namespace shardema {

/// Named tensors in a fixed order plus string metadata.
struct TensorFile {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> metadata;

  /// Tensor by name; c10::IndexError naming it (and the file, if known) when absent.
  const at::Tensor& at(const std::string& name) const;
  /// Whether a tensor of this name is present.
  bool contains(const std::string& name) const;
};

/// Writes the tensors (CPU or not: they are copied to host memory as needed;
/// non-contiguous ones are written in row-major order) in the given order,
/// crash-safely (AtomicFileWriter). Supported dtypes: float64/32/16,
/// bfloat16, int64/32/16/8, uint8, bool; others c10::TypeError naming the
/// tensor. Blocks.
void writeTensorFile(const std::string& path, const TensorFile& file);

/// Reads and validates the header (parseSafetensorsHeader) before reading
/// any data; returns CPU tensors that own their memory, in file order.
/// c10::ValueError naming the file on any problem (missing, truncated,
/// corrupt). Blocks.
TensorFile readTensorFile(const std::string& path);

/// Validates a file and returns its header without loading tensor data.
SafetensorsHeader readTensorFileHeader(const std::string& path);

/// Whether tensor files can hold this dtype (the list writeTensorFile
/// names); what is tracked as a copy must be, or it could never be saved.
bool tensorFilesCanHold(c10::ScalarType dtype);

/// Metadata keys we write are prefixed so; "shardema.format" = "1".
constexpr const char* kMetadataPrefix = "shardema.";
constexpr const char* kFormatKey = "shardema.format";
constexpr const char* kFormatVersion = "1";

}  // namespace shardema
