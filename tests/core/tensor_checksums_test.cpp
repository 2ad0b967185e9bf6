// Per-tensor checksums in a single file's metadata ("shardema.xxh64"):
// written by every writer, checked by every whole-tensor read, and by
// TensorFileReader::verifyChecksums for files read in ranges.
#include "shardema/core/tensor_checksums.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/core/tensor_file_writer.h"
#include "support/file_bytes.h"
#include "support/foreign_tensor_file.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

// The message of the c10::ValueError `read` throws ("" when none).
template <typename F>
std::string valueError(F&& read) {
  try {
    read();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

class TensorChecksumsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.file("ema.safetensors");
    TensorFile file;
    file.tensors.emplace_back("w", at::arange(64, at::kFloat).reshape({2, 32}));
    file.tensors.emplace_back("b", at::linspace(-1, 1, 16, at::kFloat));
    writeTensorFile(path_, file);
    bytes_ = testing::readFileBytes(path_);
    const SafetensorsHeader header = readTensorFileHeader(path_);
    bDataByte_ = header.dataOffset + header.find("b")->begin + 5;
  }
  // Rewrites the file with one byte changed.
  void flipByte(uint64_t at) {
    std::string bytes = bytes_;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
    testing::writeFileBytes(path_, bytes);
  }
  void replaceInHeader(const std::string& from, const std::string& to) {
    std::string bytes = bytes_;
    const size_t at = bytes.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    ASSERT_EQ(from.size(), to.size());
    bytes.replace(at, from.size(), to);
    testing::writeFileBytes(path_, bytes);
  }
  void expectTensorFails(const std::string& message, const std::string& tensor) {
    EXPECT_NE(message.find(path_ + ": tensor '" + tensor + "' fails its checksum"),
              std::string::npos)
        << message;
  }

  testing::TempDir dir_;
  std::string path_;
  std::string bytes_;
  uint64_t bDataByte_ = 0;
};

TEST_F(TensorChecksumsTest, AFlippedDataByteNamesTheFileAndTheTensor) {
  flipByte(bDataByte_);
  expectTensorFails(valueError([&] { readTensorFile(path_); }), "b");
  const TensorFileReader reader(path_);
  EXPECT_NO_THROW(reader.read("w"));  // the other tensor is intact
  expectTensorFails(valueError([&] { reader.read("b"); }), "b");
  expectTensorFails(valueError([&] { reader.verifyChecksums(7); }), "b");
  // A range read cannot check a part; it returns the bytes as they are.
  EXPECT_NO_THROW(reader.readRange("b", 0, 16));
}

TEST_F(TensorChecksumsTest, ADtypeOrShapeEditOfTheHeaderFails) {
  replaceInHeader("\"dtype\":\"F32\"", "\"dtype\":\"I32\"");
  const std::string dtypeEdit = valueError([&] { readTensorFile(path_); });
  EXPECT_TRUE(dtypeEdit.find("tensor 'w' fails its checksum") != std::string::npos ||
              dtypeEdit.find("tensor 'b' fails its checksum") != std::string::npos)
      << dtypeEdit;
  replaceInHeader("\"shape\":[2,32]", "\"shape\":[4,16]");
  expectTensorFails(valueError([&] { readTensorFile(path_); }), "w");
}

TEST_F(TensorChecksumsTest, AnEditedChecksumEntryIsRefusedAtOpen) {
  replaceInHeader("{\\\"w\\\":", "{\\\"v\\\":");
  const std::string renamed = valueError([&] { TensorFileReader reader(path_); });
  EXPECT_NE(renamed.find("shardema.xxh64 has no checksum for tensor 'w'"), std::string::npos)
      << renamed;
  const size_t digit = bytes_.find("\\\"b\\\":\\\"") + 8;
  std::string bytes = bytes_;
  bytes[digit] = 'z';
  testing::writeFileBytes(path_, bytes);
  const std::string malformed = valueError([&] { readTensorFile(path_); });
  EXPECT_NE(malformed.find("the checksum of tensor 'b' is not 16 hex digits"), std::string::npos)
      << malformed;
}

TEST_F(TensorChecksumsTest, FilesWithoutChecksumsStillLoad) {
  const std::string foreign = dir_.file("foreign.safetensors");
  testing::writeForeignTensorFile(foreign, {{"w", at::ones({3}, at::kFloat)}}, {{"k", "v"}});
  const TensorFile file = readTensorFile(foreign);
  EXPECT_TRUE(file.at("w").equal(at::ones({3}, at::kFloat)));
  const TensorFileReader reader(foreign);
  EXPECT_FALSE(reader.hasChecksums());
  EXPECT_NO_THROW(reader.verifyChecksums());
}

TEST_F(TensorChecksumsTest, AChecksumKeyFromTheCallerIsRecomputedNotTrusted) {
  // A file read back and written again carries the old key in its metadata.
  TensorFile file = readTensorFile(path_);
  file.tensors[1].second = file.tensors[1].second + 1;
  const std::string again = dir_.file("again.safetensors");
  writeTensorFile(again, file);
  EXPECT_TRUE(readTensorFile(again).at("b").equal(file.tensors[1].second));
  EXPECT_TRUE(TensorFileReader(again).hasChecksums());
}

TEST_F(TensorChecksumsTest, TheStreamingWriterMatchesWriteTensorFileByteForByte) {
  const std::string streamed = dir_.file("streamed.safetensors");
  TensorFileWriter writer(streamed, {{"w", at::kFloat, {2, 32}}, {"b", at::kFloat, {16}}});
  const at::Tensor w = at::arange(64, at::kFloat);
  writer.append(w.slice(0, 0, 10));
  writer.append(w.slice(0, 10, 64));
  writer.append(at::linspace(-1, 1, 16, at::kFloat));
  writer.commit();
  EXPECT_EQ(testing::readFileBytes(streamed), bytes_);
  EXPECT_EQ(writer.checksum(), fileChecksum(streamed));
}

}  // namespace
}  // namespace shardema
