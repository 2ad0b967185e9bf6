#include "shardema/core/tensor_dtype.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardema {
namespace {

struct Expected {
  FileDType dtype;
  const char* name;
  int size;
};

// Written out from the safetensors specification, not from our table.
const std::vector<Expected> kSpec = {
    {FileDType::kF64, "F64", 8},   {FileDType::kF32, "F32", 4}, {FileDType::kF16, "F16", 2},
    {FileDType::kBF16, "BF16", 2}, {FileDType::kI64, "I64", 8}, {FileDType::kI32, "I32", 4},
    {FileDType::kI16, "I16", 2},   {FileDType::kI8, "I8", 1},   {FileDType::kU8, "U8", 1},
    {FileDType::kBool, "BOOL", 1},
};

TEST(FileDTypeTest, NamesMatchSafetensorsSpelling) {
  for (const Expected& e : kSpec) EXPECT_STREQ(fileDTypeName(e.dtype), e.name);
}

TEST(FileDTypeTest, SizesAreBytesPerElement) {
  for (const Expected& e : kSpec) EXPECT_EQ(fileDTypeSize(e.dtype), e.size) << e.name;
}

TEST(FileDTypeTest, ParseInvertsName) {
  for (const Expected& e : kSpec) {
    auto parsed = parseFileDType(e.name);
    ASSERT_TRUE(parsed.has_value()) << e.name;
    EXPECT_EQ(*parsed, e.dtype) << e.name;
  }
}

TEST(FileDTypeTest, ParseRejectsUnknownAndMisspelledNames) {
  for (const char* name :
       {"", "f32", "FP32", "F32 ", "U16", "U32", "U64", "F8_E4M3", "C64", "bool", "BOOL\n"}) {
    EXPECT_FALSE(parseFileDType(name).has_value()) << '"' << name << '"';
  }
  EXPECT_FALSE(parseFileDType(std::string("F32\0", 4)).has_value());
}

}  // namespace
}  // namespace shardema
