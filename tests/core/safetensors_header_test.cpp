#include "shardema/core/safetensors_header.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardema {
namespace {

constexpr const char* kSource = "bad.safetensors";

// A whole file: 8-byte little-endian length, the JSON text as given, then
// `dataBytes` zero bytes. Hand-built, so it does not trust our builder.
std::string fileWith(const std::string& json, size_t dataBytes = 0) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((json.size() >> (8 * i)) & 0xff));
  return out + json + std::string(dataBytes, '\0');
}

SafetensorsHeader parse(const std::string& file) {
  return parseSafetensorsHeader(reinterpret_cast<const uint8_t*>(file.data()), file.size(),
                                file.size(), kSource);
}

// Expects a c10::ValueError whose one-line message names the file first and
// contains `needle`.
void expectRejected(const std::string& file, const std::string& needle) {
  try {
    parse(file);
    ADD_FAILURE() << "accepted, expected an error containing '" << needle << "'";
  } catch (const c10::ValueError& error) {
    const std::string& msg = error.msg();
    EXPECT_EQ(msg.rfind(std::string(kSource) + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

const std::string kOneF32 = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

TEST(SafetensorsHeaderTest, ParsesValidHeader) {
  const std::string json =
      R"({"__metadata__":{"k":"v"},"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"I64","shape":[],"data_offsets":[12,20]}})";
  const SafetensorsHeader header = parse(fileWith(json, 20));
  ASSERT_EQ(header.tensors.size(), 2u);
  EXPECT_EQ(header.tensors[0].name, "w");
  EXPECT_EQ(header.tensors[0].dtype, FileDType::kBF16);
  EXPECT_EQ(header.tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(header.tensors[0].numel(), 6);
  EXPECT_EQ(header.tensors[1].name, "b");
  EXPECT_EQ(header.tensors[1].numel(), 1);
  EXPECT_EQ(header.tensors[1].begin, 12u);
  EXPECT_EQ(header.tensors[1].byteSize(), 8u);
  EXPECT_EQ(header.metadata, (std::map<std::string, std::string>{{"k", "v"}}));
  EXPECT_EQ(header.dataSize, 20u);
  EXPECT_EQ(header.dataOffset, 8 + json.size());
  EXPECT_NE(header.find("b"), nullptr);
  EXPECT_EQ(header.find("missing"), nullptr);
}

TEST(SafetensorsHeaderTest, SortsByOffsetAndKeepsJsonOrderForTies) {
  // JSON order differs from data order; two empty tensors share offset 4.
  const SafetensorsHeader header =
      parse(fileWith(R"({"late":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},)"
                     R"("empty2":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                     R"("empty1":{"dtype":"F32","shape":[3,0],"data_offsets":[4,4]},)"
                     R"("early":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})",
                     8));
  std::vector<std::string> names;
  for (const TensorEntry& entry : header.tensors) names.push_back(entry.name);
  EXPECT_EQ(names, (std::vector<std::string>{"early", "empty2", "empty1", "late"}));
}

TEST(SafetensorsHeaderTest, AcceptsPaddingUnknownFieldsAndEmptyHeader) {
  EXPECT_EQ(parse(fileWith(kOneF32 + "      ", 8)).tensors.size(), 1u);
  EXPECT_EQ(parse(fileWith(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[1]}})", 1))
                .tensors.size(),
            1u);
  // "-0" is an integer zero to JSON parsers (and to serde): accepted.
  EXPECT_EQ(parse(fileWith(R"({"a":{"dtype":"U8","shape":[-0],"data_offsets":[-0,0]}})"))
                .tensors[0]
                .numel(),
            0);
  const SafetensorsHeader empty = parse(fileWith("{}"));
  EXPECT_TRUE(empty.tensors.empty());
  EXPECT_TRUE(empty.metadata.empty());
}

TEST(SafetensorsHeaderTest, RoundTripsThroughBuilder) {
  std::vector<TensorEntry> entries(4);
  entries[0] = {"layer.0.weight", FileDType::kF32, {3, 5}};
  entries[1] = {"scalar", FileDType::kF64, {}};
  entries[2] = {"empty", FileDType::kBF16, {0, 7}};
  entries[3] = {"m\u00e4sk \"q\"\n", FileDType::kBool, {9}};
  const std::map<std::string, std::string> metadata = {{"shardema.step", "12"}, {"x", "\u00fc"}};
  const std::string header = buildSafetensorsHeader(entries, metadata);
  EXPECT_EQ(header.size() % 8, 0u);
  EXPECT_EQ(entries[0].begin, 0u);
  EXPECT_EQ(entries[0].end, 60u);
  EXPECT_EQ(entries[1].begin, 60u);
  EXPECT_EQ(entries[2].begin, 68u);
  EXPECT_EQ(entries[2].end, 68u);
  EXPECT_EQ(entries[3].end, 77u);

  const std::string file = header + std::string(77, '\0');
  const SafetensorsHeader parsed = parse(file);
  EXPECT_EQ(parsed.dataOffset, header.size());
  EXPECT_EQ(parsed.metadata, metadata);
  ASSERT_EQ(parsed.tensors.size(), entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ(parsed.tensors[i].name, entries[i].name);
    EXPECT_EQ(parsed.tensors[i].dtype, entries[i].dtype);
    EXPECT_EQ(parsed.tensors[i].shape, entries[i].shape);
    EXPECT_EQ(parsed.tensors[i].begin, entries[i].begin);
    EXPECT_EQ(parsed.tensors[i].end, entries[i].end);
  }
}

TEST(SafetensorsHeaderTest, ReadsLengthLittleEndian) {
  const uint8_t bytes[8] = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01};
  EXPECT_EQ(readSafetensorsHeaderLength(bytes, 8, kSource), 0x0102030405060708ull);
  EXPECT_THROW(readSafetensorsHeaderLength(bytes, 7, kSource), c10::ValueError);
}

TEST(SafetensorsHeaderTest, RejectsFileShorterThanLengthPrefix) {
  expectRejected(std::string(5, '\0'), "too short");
}

TEST(SafetensorsHeaderTest, RejectsHeaderLengthPastFileEnd) {
  std::string file = fileWith(kOneF32, 8);
  file[0] = static_cast<char>(file.size());  // claims more than the file holds
  expectRejected(file, "exceeds the");
}

TEST(SafetensorsHeaderTest, RejectsHeaderLengthAboveLimit) {
  std::string file(16, '\0');
  file[4] = 0x01;  // N = 2^32
  expectRejected(file, "limit");
}

TEST(SafetensorsHeaderTest, RejectsIncompletePrefix) {
  const std::string file = fileWith(kOneF32, 8);
  try {
    parseSafetensorsHeader(reinterpret_cast<const uint8_t*>(file.data()), 20, file.size(), kSource);
    ADD_FAILURE() << "accepted a prefix missing part of the header";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(error.msg().find("header were given"), std::string::npos) << error.msg();
  }
}

TEST(SafetensorsHeaderTest, RejectsMalformedJson) {
  expectRejected(fileWith(R"({"a":{"dtype":"F32",)"), "not valid JSON");
  expectRejected(fileWith(kOneF32 + "x", 8), "not valid JSON");
  expectRejected(fileWith(std::string("{\"a\0\":1}", 8)), "not valid JSON");
  expectRejected(fileWith("{\"\xff\xfe\":1}"), "not valid JSON");
  expectRejected(fileWith(""), "not valid JSON");
}

TEST(SafetensorsHeaderTest, RejectsNonObjectRoot) {
  expectRejected(fileWith("[1,2]"), "must be a JSON object");
  expectRejected(fileWith("\"text\""), "must be a JSON object");
}

TEST(SafetensorsHeaderTest, RejectsNonObjectEntry) {
  expectRejected(fileWith(R"({"a":[1]})"), "\"a\": entry must be a JSON object");
}

TEST(SafetensorsHeaderTest, RejectsUnknownDtype) {
  expectRejected(fileWith(R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", 8),
                 "\"a\": unknown dtype \"f32\"");
  expectRejected(fileWith(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8),
                 "\"dtype\" must be a string");
  expectRejected(fileWith(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8),
                 "\"dtype\" must be a string");
}

TEST(SafetensorsHeaderTest, RejectsBadShape) {
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})"),
                 "\"a\": shape dimensions must be non-negative");
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", 2),
                 "non-negative integers");
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":["2"],"data_offsets":[0,2]}})", 2),
                 "found string");
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":2,"data_offsets":[0,2]}})", 2),
                 "\"shape\" must be an array");
  expectRejected(
      fileWith(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,0]}})"),
      "below 2^63");
}

TEST(SafetensorsHeaderTest, RejectsShapeSizeMismatch) {
  expectRejected(fileWith(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                 "\"a\": shape [3] of F32 needs 12 bytes but data_offsets span 8");
}

TEST(SafetensorsHeaderTest, RejectsShapeOverflow) {
  // 2^32 * 2^32 * 4 bytes wraps to 0 in 64 bits: must not pass as empty.
  expectRejected(
      fileWith(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
      "overflows");
  // A zero dimension does not excuse an overflowing product.
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[4611686018427387904,4,0],)"
                          R"("data_offsets":[0,0]}})"),
                 "overflows");
}

TEST(SafetensorsHeaderTest, RejectsBadDataOffsets) {
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0]}})"),
                 "must be [begin, end]");
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,-1]}})"),
                 "non-negative integers");
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[4,2]}})", 4),
                 "begin 4 is after end 2");
}

TEST(SafetensorsHeaderTest, RejectsOffsetsPastDataArea) {
  expectRejected(fileWith(kOneF32, 7), "\"a\": data_offsets end 8 is past the data area of 7");
}

TEST(SafetensorsHeaderTest, RejectsOverlap) {
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                          6),
                 "\"b\" (bytes 2-6) overlaps tensor \"a\"");
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                          4),
                 "overlaps");
}

TEST(SafetensorsHeaderTest, RejectsHole) {
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[5,9]}})",
                          9),
                 "bytes 4-5 of the data area belong to no tensor (hole before tensor \"b\")");
  expectRejected(fileWith(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[1,5]}})", 5), "hole");
}

TEST(SafetensorsHeaderTest, RejectsTrailingBytes) {
  expectRejected(fileWith(kOneF32, 9), "data area is 9 bytes but the tensors cover only 8");
  expectRejected(fileWith("{}", 1), "trailing");
}

TEST(SafetensorsHeaderTest, RejectsDuplicateTensorName) {
  expectRejected(fileWith(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                          R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                          2),
                 "duplicate key \"a\" (a tensor name)");
}

TEST(SafetensorsHeaderTest, RejectsDuplicateKeyInsideEntryOrMetadata) {
  expectRejected(
      fileWith(R"({"a":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", 1),
      "duplicate key \"dtype\" inside \"a\"");
  expectRejected(fileWith(R"({"__metadata__":{"k":"1","k":"2"}})"), "duplicate key \"k\"");
}

TEST(SafetensorsHeaderTest, RejectsEmptyName) {
  expectRejected(fileWith(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1),
                 "empty name");
}

TEST(SafetensorsHeaderTest, RejectsNonStringMetadataValue) {
  expectRejected(fileWith(R"({"__metadata__":{"step":12}})"),
                 "metadata \"step\" must be a string, found number");
}

TEST(SafetensorsHeaderTest, RejectsNonObjectMetadata) {
  expectRejected(fileWith(R"({"__metadata__":["a","b"]})"), "\"__metadata__\" must be an object");
  expectRejected(fileWith(R"({"__metadata__":null})"), "must be an object");
}

TEST(SafetensorsHeaderTest, RejectsDeepNesting) {
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  expectRejected(fileWith(R"({"a":)" + deep + "}"), "nested deeper than");
}

TEST(SafetensorsHeaderTest, NamesTensorInErrorsWithoutBreakingTheLine) {
  expectRejected(fileWith(R"({"x\ny":{"dtype":"Q","shape":[],"data_offsets":[0,0]}})"),
                 "\"x\\ny\": unknown dtype");
}

TEST(SafetensorsHeaderTest, BuilderRejectsBadEntries) {
  auto expectBuildError = [](std::vector<TensorEntry> entries, const std::string& needle) {
    try {
      buildSafetensorsHeader(entries, {}, "out.safetensors");
      ADD_FAILURE() << "built, expected '" << needle << "'";
    } catch (const c10::ValueError& error) {
      EXPECT_EQ(error.msg().rfind("out.safetensors: ", 0), 0u) << error.msg();
      EXPECT_NE(error.msg().find(needle), std::string::npos) << error.msg();
    }
  };
  expectBuildError({{"a", FileDType::kF32, {1}}, {"a", FileDType::kF32, {1}}},
                   "duplicate tensor name \"a\"");
  expectBuildError({{"", FileDType::kF32, {1}}}, "empty name");
  expectBuildError({{"__metadata__", FileDType::kF32, {1}}}, "reserved");
  expectBuildError({{"neg", FileDType::kF32, {2, -1}}}, "\"neg\": shape has a negative");
  expectBuildError({{"bad\xff", FileDType::kU8, {1}}}, "not valid UTF-8");
  std::vector<TensorEntry> ok = {{"a", FileDType::kU8, {1}}};
  EXPECT_THROW(buildSafetensorsHeader(ok, {{"k", "\xc3"}}), c10::ValueError);
}

TEST(SafetensorsHeaderTest, BuilderWritesNoMetadataKeyWhenEmpty) {
  std::vector<TensorEntry> entries;
  const std::string header = buildSafetensorsHeader(entries, {});
  EXPECT_EQ(header.size(), 16u);
  EXPECT_EQ(header.substr(8), "{}      ");
}

}  // namespace
}  // namespace shardema
