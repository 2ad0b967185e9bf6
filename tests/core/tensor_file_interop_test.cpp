// Interop with an independent implementation of the format: the venv's Python
// with numpy reads our files and writes files we read (tests/python/).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "shardema/core/tensor_file.h"
#include "support/command_output.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

// Same rows as tests/python/interop_values.py; the seed is the row index.
struct Row {
  const char* name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
const std::vector<Row> kTable = {
    {"weights.f64", at::kDouble, {3, 5}}, {"weights.f32", at::kFloat, {2, 3, 4}},
    {"weights.f16", at::kHalf, {7}},      {"weights.bf16", at::kBFloat16, {4, 4}},
    {"count.i64", at::kLong, {6}},        {"count.i32", at::kInt, {2, 5}},
    {"count.i16", at::kShort, {9}},       {"count.i8", at::kChar, {3, 3}},
    {"bytes.u8", at::kByte, {300}},       {"mask.bool", at::kBool, {11}},
    {"scalar.f32", at::kFloat, {}},       {"empty.f32", at::kFloat, {0, 4}},
    {"empty.bf16", at::kBFloat16, {0}},
};

// interop_values.expected_value, transcribed.
double floatValue(int64_t seed, int64_t i) { return (seed + 1) + ((i * 7) % 61 - 30) * 0.125; }

int64_t intValue(int64_t seed, at::ScalarType dtype, int64_t i) {
  switch (dtype) {
    case at::kLong:
      return (seed + 1) * 1000000000000LL + (i % 2 ? -1 : 1) * i * 987654321LL;
    case at::kInt:
      return (seed + 1) * 1000000 - i * 7919;
    case at::kShort:
      return (i * 263 + seed) % 65536 - 32768;
    case at::kChar:
      return (i * 37 + seed) % 256 - 128;
    case at::kByte:
      return (i * 151 + seed) % 256;
    case at::kBool:
      return (i + seed) % 3 == 0 ? 1 : 0;
    default:
      ADD_FAILURE() << "not an integer dtype";
      return 0;
  }
}

// Float64 (float dtypes) or int64 values, not yet cast to the row's dtype.
at::Tensor expectedWide(int64_t seed, const Row& row) {
  const int64_t numel = c10::multiply_integers(row.shape);
  if (at::isFloatingType(row.dtype)) {
    at::Tensor out = at::empty({numel}, at::kDouble);
    for (int64_t i = 0; i < numel; ++i) out.data_ptr<double>()[i] = floatValue(seed, i);
    return out.reshape(row.shape);
  }
  at::Tensor out = at::empty({numel}, at::kLong);
  for (int64_t i = 0; i < numel; ++i) out.data_ptr<int64_t>()[i] = intValue(seed, row.dtype, i);
  return out.reshape(row.shape);
}

TensorFile expectedFile() {
  TensorFile file;
  for (size_t seed = 0; seed < kTable.size(); ++seed) {
    file.tensors.emplace_back(
        kTable[seed].name,
        expectedWide(static_cast<int64_t>(seed), kTable[seed]).to(kTable[seed].dtype));
  }
  return file;
}

using testing::runPythonScript;

TEST(TensorFileInteropTest, NumpyReadsOurFile) {
  testing::TempDir dir;
  const std::string path = dir.file("ours.safetensors");
  writeTensorFile(path, expectedFile());
  const testing::CommandResult result = runPythonScript("read_safetensors.py", path);
  EXPECT_EQ(result.exitCode, 0) << result.output;
}

// The control: the Python checker must notice one wrong element, or the
// test above proves nothing.
TEST(TensorFileInteropTest, NumpyReaderCatchesOneWrongValue) {
  testing::TempDir dir;
  for (const char* victim : {"weights.bf16", "count.i64", "mask.bool"}) {
    SCOPED_TRACE(victim);
    TensorFile file = expectedFile();
    for (auto& [name, tensor] : file.tensors) {
      if (name != victim) continue;
      at::Tensor element = tensor.view(-1)[5];
      if (tensor.scalar_type() == at::kBool) {
        element.logical_not_();
      } else {
        element.add_(1);
      }
    }
    const std::string path = dir.file("wrong.safetensors");
    writeTensorFile(path, file);
    const testing::CommandResult result = runPythonScript("read_safetensors.py", path);
    EXPECT_EQ(result.exitCode, 1) << result.output;
    EXPECT_NE(result.output.find(victim), std::string::npos) << result.output;
  }
}

// The control of the Python checksum check: one byte changed after the
// write, under the checksum the file declares, is a mismatch for xxhash too.
TEST(TensorFileInteropTest, PythonXxhashRecomputesOurTensorChecksums) {
  testing::TempDir dir;
  const std::string path = dir.file("flipped.safetensors");
  writeTensorFile(path, expectedFile());
  const SafetensorsHeader header = readTensorFileHeader(path);
  const TensorEntry* victim = header.find("count.i64");
  ASSERT_NE(victim, nullptr);
  std::string bytes = testing::readFileBytes(path);
  bytes[header.dataOffset + victim->begin + 8] ^= 0x04;
  testing::writeFileBytes(path, bytes);
  const testing::CommandResult result = runPythonScript("read_safetensors.py", path);
  EXPECT_EQ(result.exitCode, 1) << result.output;
  EXPECT_NE(result.output.find("count.i64: shardema.xxh64 says"), std::string::npos)
      << result.output;
}

TEST(TensorFileInteropTest, WeReadNumpyWrittenFile) {
  testing::TempDir dir;
  const std::string path = dir.file("numpy.safetensors");
  const testing::CommandResult result = runPythonScript("write_safetensors.py", path);
  ASSERT_EQ(result.exitCode, 0) << result.output;

  const TensorFile file = readTensorFile(path);
  ASSERT_EQ(file.tensors.size(), kTable.size());
  for (size_t seed = 0; seed < kTable.size(); ++seed) {
    const Row& row = kTable[seed];
    SCOPED_TRACE(row.name);
    ASSERT_TRUE(file.contains(row.name));
    const at::Tensor& actual = file.at(row.name);
    EXPECT_EQ(actual.scalar_type(), row.dtype);
    ASSERT_EQ(actual.sizes(), at::IntArrayRef(row.shape));
    const at::Tensor want = expectedWide(static_cast<int64_t>(seed), row);
    EXPECT_TRUE(actual.to(want.scalar_type()).equal(want));
  }
  // The writer put data in reverse table order; file order follows offsets,
  // and the two empty tensors, both at offset 0, keep their JSON order.
  std::vector<std::string> order = {"empty.f32", "empty.bf16"};
  for (size_t row = kTable.size() - 2; row-- > 0;) order.push_back(kTable[row].name);
  std::vector<std::string> names;
  for (const auto& item : file.tensors) names.push_back(item.first);
  EXPECT_EQ(names, order);
  EXPECT_EQ(file.metadata.at("shardema.format"), "1");
  EXPECT_EQ(file.metadata.at("caf\u00e9"), "\u00fcml\u00e4ut");
}

}  // namespace
}  // namespace shardema
