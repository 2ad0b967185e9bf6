#include "shardema/core/tensor_dtype.h"

#include <c10/util/Exception.h>

#include <iterator>

namespace shardema {
namespace {

struct DTypeInfo {
  FileDType dtype;
  const char* name;
  int size;
};

// Indexed by the enum value; the static_assert below keeps the two in step.
constexpr DTypeInfo kDTypes[] = {
    {FileDType::kF64, "F64", 8},   {FileDType::kF32, "F32", 4}, {FileDType::kF16, "F16", 2},
    {FileDType::kBF16, "BF16", 2}, {FileDType::kI64, "I64", 8}, {FileDType::kI32, "I32", 4},
    {FileDType::kI16, "I16", 2},   {FileDType::kI8, "I8", 1},   {FileDType::kU8, "U8", 1},
    {FileDType::kBool, "BOOL", 1},
};
static_assert(std::size(kDTypes) == static_cast<size_t>(FileDType::kBool) + 1,
              "kDTypes must list every FileDType in enum order");

constexpr bool tableInEnumOrder() {
  for (size_t i = 0; i < std::size(kDTypes); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(tableInEnumOrder(), "kDTypes must be in enum order");

const DTypeInfo& info(FileDType dtype) {
  const auto index = static_cast<size_t>(dtype);
  TORCH_INTERNAL_ASSERT(index < std::size(kDTypes), "FileDType out of range: ", index);
  return kDTypes[index];
}

}  // namespace

const char* fileDTypeName(FileDType dtype) { return info(dtype).name; }

int fileDTypeSize(FileDType dtype) { return info(dtype).size; }

std::optional<FileDType> parseFileDType(const std::string& name) {
  // Exact, case-sensitive match: the safetensors reference rejects "f32".
  for (const DTypeInfo& entry : kDTypes) {
    if (name == entry.name) return entry.dtype;
  }
  return std::nullopt;
}

}  // namespace shardema
