#include "shardema/core/tensor_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "shardema/core/checksum.h"
#include "support/file_bytes.h"
#include "support/foreign_tensor_file.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

// Same dtype, shape and bytes (bitwise: NaN payloads and -0.0 included).
void expectSameTensor(const at::Tensor& actual, const at::Tensor& expected,
                      const std::string& name) {
  SCOPED_TRACE(name);
  ASSERT_TRUE(actual.defined());
  EXPECT_EQ(actual.scalar_type(), expected.scalar_type());
  ASSERT_EQ(actual.sizes(), expected.sizes());
  EXPECT_TRUE(actual.is_cpu());
  EXPECT_TRUE(actual.is_contiguous());
  const at::Tensor want = expected.contiguous();
  ASSERT_EQ(actual.nbytes(), want.nbytes());
  if (want.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(actual.data_ptr(), want.data_ptr(), want.nbytes()), 0);
  }
}

// Values encode the tensor's index and the element's index, so a swapped or
// shifted tensor shows up as a mismatch.
at::Tensor patterned(int64_t seed, at::IntArrayRef shape, at::ScalarType dtype) {
  const int64_t numel = c10::multiply_integers(shape);
  at::Tensor index = at::arange(numel, at::kDouble);
  at::Tensor values;
  if (dtype == at::kBool) {
    values = (index + seed).remainder(3).eq(0);
  } else if (at::isFloatingType(dtype)) {
    values = index.remainder(61).sub(30).mul(0.125).add(seed);
  } else {
    values = index.mul(37).add(seed).remainder(100).sub(dtype == at::kByte ? 0 : 50);
  }
  return values.to(dtype).reshape(shape);
}

const at::ScalarType kAllTypes[] = {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                    at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};

// Expects c10::Error of type E whose message starts with the path.
template <typename E, typename F>
void expectErrorNamingFile(F&& action, const std::string& path, const std::string& needle) {
  try {
    action();
    ADD_FAILURE() << "no error, expected '" << needle << "'";
  } catch (const E& error) {
    EXPECT_EQ(error.msg().rfind(path + ": ", 0), 0u) << error.msg();
    EXPECT_NE(error.msg().find(needle), std::string::npos) << error.msg();
  }
}

// Writes one fp32 tensor "w" of `numel` elements to `path`; its bytes.
std::string writeOneTensor(const std::string& path, int64_t numel) {
  TensorFile file;
  file.tensors.emplace_back("w", patterned(1, {numel}, at::kFloat));
  writeTensorFile(path, file);
  return testing::readFileBytes(path);
}

// The file at `path` with `bytes`, then the read's error names the file and
// says `needle`.
void expectReadRefuses(const std::string& path, const std::string& bytes,
                       const std::string& needle) {
  testing::writeFileBytes(path, bytes);
  expectErrorNamingFile<c10::ValueError>([&] { readTensorFile(path); }, path, needle);
}

TEST(TensorFileTest, RoundTripsEveryDtype) {
  testing::TempDir dir;
  TensorFile file;
  int64_t seed = 0;
  for (at::ScalarType dtype : kAllTypes) {
    file.tensors.emplace_back(std::string("t.") + c10::toString(dtype),
                              patterned(++seed, {3, 7}, dtype));
  }
  // Exact bit patterns that arithmetic would not produce.
  file.tensors.emplace_back("specials", at::tensor({-0.0, NAN, INFINITY, -INFINITY, 1e-310}));
  writeTensorFile(dir.file("all.safetensors"), file);
  const TensorFile read = readTensorFile(dir.file("all.safetensors"));
  ASSERT_EQ(read.tensors.size(), file.tensors.size());
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    EXPECT_EQ(read.tensors[i].first, file.tensors[i].first);
    expectSameTensor(read.tensors[i].second, file.tensors[i].second, file.tensors[i].first);
  }
}

TEST(TensorFileTest, RoundTripsScalarsAndEmptyTensors) {
  testing::TempDir dir;
  TensorFile file;
  file.tensors.emplace_back("scalar", at::scalar_tensor(2.5, at::kFloat));
  file.tensors.emplace_back("empty", at::empty({0}, at::kBFloat16));
  file.tensors.emplace_back("empty3d", at::empty({3, 0, 2}, at::kLong));
  file.tensors.emplace_back("after", patterned(4, {5}, at::kHalf));
  writeTensorFile(dir.file("e.safetensors"), file);
  const TensorFile read = readTensorFile(dir.file("e.safetensors"));
  ASSERT_EQ(read.tensors.size(), 4u);
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    EXPECT_EQ(read.tensors[i].first, file.tensors[i].first);
    expectSameTensor(read.tensors[i].second, file.tensors[i].second, file.tensors[i].first);
  }
  EXPECT_EQ(read.at("scalar").dim(), 0);
  EXPECT_EQ(read.at("scalar").item<float>(), 2.5f);
}

TEST(TensorFileTest, WritesNonContiguousTensorsInRowMajorOrder) {
  testing::TempDir dir;
  const at::Tensor base = patterned(1, {4, 6}, at::kFloat);
  TensorFile file;
  file.tensors.emplace_back("transposed", base.t());
  file.tensors.emplace_back("strided", base.slice(0, 1, 4).slice(1, 0, 6, 2));
  file.tensors.emplace_back("expanded", patterned(2, {1, 3}, at::kInt).expand({4, 3}));
  file.tensors.emplace_back(
      "channels_last",
      patterned(3, {2, 3, 2, 2}, at::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast));
  for (const auto& item : file.tensors) ASSERT_FALSE(item.second.is_contiguous()) << item.first;
  writeTensorFile(dir.file("nc.safetensors"), file);
  const TensorFile read = readTensorFile(dir.file("nc.safetensors"));
  for (const auto& [name, tensor] : file.tensors) {
    // contiguous() is ATen's row-major order; compare values, not storage.
    expectSameTensor(read.at(name), tensor.contiguous(), name);
    EXPECT_TRUE(read.at(name).equal(tensor)) << name;
  }
}

TEST(TensorFileTest, WritesTheSafetensorsLayoutExactly) {
  testing::TempDir dir;
  const std::string path = dir.file("layout.safetensors");
  TensorFile file;
  file.tensors.emplace_back("b", patterned(1, {3}, at::kShort));
  file.tensors.emplace_back("a", patterned(2, {2, 2}, at::kDouble));
  file.metadata["shardema.step"] = "7";
  writeTensorFile(path, file);

  // Decode by hand, independently of our parser.
  const std::string bytes = testing::readFileBytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  ASSERT_EQ(bytes.size(), 8 + n + 6 + 32);
  EXPECT_EQ((8 + n) % 8, 0u);
  const auto json = nlohmann::json::parse(bytes.substr(8, n));
  // Every file carries its per-tensor checksums: XXH64 of "<dtype>[<shape>]"
  // then the tensor's bytes, in file order (tensor_checksums.h).
  const auto digest = [&](const std::string& prefix, const at::Tensor& t) {
    const std::string text =
        prefix + std::string(static_cast<const char*>(t.data_ptr()), t.nbytes());
    return checksumHex(xxh64(text.data(), text.size()));
  };
  const std::string checksums = "{\"b\":\"" + digest("I16[3]", file.tensors[0].second) +
                                "\",\"a\":\"" + digest("F64[2,2]", file.tensors[1].second) + "\"}";
  EXPECT_EQ(json["__metadata__"],
            (nlohmann::json{
                {"shardema.format", "1"}, {"shardema.step", "7"}, {"shardema.xxh64", checksums}}));
  EXPECT_EQ(json["b"],
            (nlohmann::json{{"dtype", "I16"}, {"shape", {3}}, {"data_offsets", {0, 6}}}));
  EXPECT_EQ(json["a"],
            (nlohmann::json{{"dtype", "F64"}, {"shape", {2, 2}}, {"data_offsets", {6, 38}}}));
  const char* data = bytes.data() + 8 + n;
  EXPECT_EQ(std::memcmp(data, file.tensors[0].second.data_ptr(), 6), 0);
  EXPECT_EQ(std::memcmp(data + 6, file.tensors[1].second.data_ptr(), 32), 0);
}

TEST(TensorFileTest, KeepsMetadataAndAddsFormatKey) {
  testing::TempDir dir;
  TensorFile file;
  file.metadata = {{"shardema.kind", "posthoc_snapshot"}, {"user", "x"}};
  writeTensorFile(dir.file("m.safetensors"), file);
  const TensorFile read = readTensorFile(dir.file("m.safetensors"));
  EXPECT_TRUE(read.tensors.empty());
  EXPECT_EQ(read.metadata,
            (std::map<std::string, std::string>{{"shardema.format", "1"},
                                                {"shardema.kind", "posthoc_snapshot"},
                                                {"shardema.xxh64", "{}"},
                                                {"user", "x"}}));
  file.metadata[kFormatKey] = "2";
  expectErrorNamingFile<c10::ValueError>([&] { writeTensorFile(dir.file("f2"), file); },
                                         dir.file("f2"), "reserved");
  EXPECT_FALSE(fs::exists(dir.file("f2")));
}

TEST(TensorFileTest, ReadsHeaderWithoutData) {
  testing::TempDir dir;
  TensorFile file;
  file.tensors.emplace_back("w", patterned(1, {2, 5}, at::kBFloat16));
  writeTensorFile(dir.file("h.safetensors"), file);
  const SafetensorsHeader header = readTensorFileHeader(dir.file("h.safetensors"));
  ASSERT_EQ(header.tensors.size(), 1u);
  EXPECT_EQ(header.tensors[0].dtype, FileDType::kBF16);
  EXPECT_EQ(header.tensors[0].shape, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(header.metadata.at(kFormatKey), kFormatVersion);
}

TEST(TensorFileTest, AtFindsByNameOrThrowsIndexError) {
  TensorFile file;
  file.tensors.emplace_back("x", at::ones({2}));
  EXPECT_TRUE(file.contains("x"));
  EXPECT_FALSE(file.contains("y"));
  EXPECT_EQ(file.at("x").numel(), 2);
  EXPECT_THROW(file.at("y"), c10::IndexError);
}

TEST(TensorFileTest, RejectsUnsupportedTensorsBeforeWriting) {
  testing::TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  TensorFile complex;
  complex.tensors.emplace_back("z", at::zeros({2}, at::kComplexFloat));
  expectErrorNamingFile<c10::TypeError>([&] { writeTensorFile(path, complex); }, path, "'z'");
  TensorFile undefined;
  undefined.tensors.emplace_back("u", at::Tensor());
  expectErrorNamingFile<c10::ValueError>([&] { writeTensorFile(path, undefined); }, path, "'u'");
  TensorFile duplicate;
  duplicate.tensors.emplace_back("d", at::ones({1}));
  duplicate.tensors.emplace_back("d", at::ones({1}));
  expectErrorNamingFile<c10::ValueError>([&] { writeTensorFile(path, duplicate); }, path,
                                         "duplicate tensor name \"d\"");
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(TensorFileTest, FailureMidWriteLeavesTheOldFile) {
  testing::TempDir dir;
  const std::string path = dir.file("keep.safetensors");
  TensorFile old;
  old.tensors.emplace_back("w", patterned(1, {8}, at::kFloat));
  writeTensorFile(path, old);
  const std::string before = testing::readFileBytes(path);

  // A meta tensor passes every check but has no bytes to copy: the writer
  // fails after the header and the first tensor went to the temp file.
  TensorFile failing;
  failing.tensors.emplace_back("w", patterned(2, {8}, at::kFloat));
  failing.tensors.emplace_back("meta", at::empty({4}, at::TensorOptions().device(at::kMeta)));
  expectErrorNamingFile<c10::Error>([&] { writeTensorFile(path, failing); }, path, "'meta'");
  EXPECT_EQ(testing::readFileBytes(path), before);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  expectSameTensor(readTensorFile(path).at("w"), old.tensors[0].second, "w");
}

TEST(TensorFileTest, MissingFileErrorNamesFile) {
  testing::TempDir dir;
  const std::string path = dir.file("absent.safetensors");
  expectErrorNamingFile<c10::ValueError>([&] { readTensorFile(path); }, path,
                                         "No such file or directory");
  expectErrorNamingFile<c10::ValueError>([&] { readTensorFile(dir.file("")); }, dir.file(""),
                                         "not a regular file");
}

TEST(TensorFileTest, TruncatedFileErrorsNameFile) {
  testing::TempDir dir;
  const std::string path = dir.file("t.safetensors");
  const std::string full = writeOneTensor(path, 16);
  // Cut in the data area, in the header, in the length prefix, to nothing.
  for (size_t keep : {full.size() - 1, full.size() - 64, size_t{20}, size_t{5}, size_t{0}}) {
    SCOPED_TRACE(keep);
    expectReadRefuses(path, full.substr(0, keep), "");
  }
  expectReadRefuses(path, full.substr(0, full.size() - 4),
                    "\"w\": data_offsets end 64 is past the data area");
}

TEST(TensorFileTest, CorruptedLengthOrHeaderErrorsNameFile) {
  testing::TempDir dir;
  const std::string path = dir.file("c.safetensors");
  const std::string full = writeOneTensor(path, 4);

  std::string huge = full;
  huge[7] = '\x7f';  // N near 2^63: must fail before any allocation
  expectReadRefuses(path, huge, "header length");

  std::string longer = full;
  longer[0] = static_cast<char>(static_cast<uint8_t>(longer[0]) + 8);
  expectReadRefuses(path, longer, "");

  std::string json = full;
  json[8] = '[';
  expectReadRefuses(path, json, "JSON");
}

TEST(TensorFileTest, RejectsBoolBytesOtherThanZeroOrOne) {
  testing::TempDir dir;
  const std::string path = dir.file("b.safetensors");
  // A file without checksums (ours would fail its checksum first).
  testing::writeForeignTensorFile(path, {{"mask", at::zeros({6}, at::kBool)}});
  std::string bytes = testing::readFileBytes(path);
  bytes[bytes.size() - 2] = 2;
  expectReadRefuses(path, bytes, "'mask': BOOL element 4 is byte 2");
}

}  // namespace
}  // namespace shardema
