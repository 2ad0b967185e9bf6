#pragma once
// The element types a safetensors file may hold, with their names and sizes.
// No torch dependency (the file-format layer is fuzzed without ATen).
#include <cstdint>
#include <optional>
#include <string>

namespace shardema {

enum class FileDType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

/// The safetensors spelling: "F64", "F32", "F16", "BF16", "I64", "I32",
/// "I16", "I8", "U8", "BOOL".
const char* fileDTypeName(FileDType dtype);
/// Bytes per element.
int fileDTypeSize(FileDType dtype);
/// Parses a safetensors dtype name; nullopt for an unknown one.
std::optional<FileDType> parseFileDType(const std::string& name);

}  // namespace shardema
