// TensorFileReader: ranges equal slices of readTensorFile's tensors for
// every (begin, count), whole reads equal readTensorFile, bad names, ranges
// and files are refused naming the file, and threads may share a reader.
#include "shardema/core/tensor_file_reader.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardema/core/tensor_file.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/tensor_file_rows.h"
#include "support/value_error.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

TensorFile sampleFile() { return testing::everyDtypeFile(); }

bool sameTensor(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.equal(b);
}

TEST(TensorFileReaderTest, EveryRangeEqualsASliceOfReadTensorFile) {
  testing::TempDir dir;
  const std::string path = dir.file("a.safetensors");
  writeTensorFile(path, sampleFile());
  const TensorFile whole = readTensorFile(path);
  const TensorFileReader reader(path);
  std::vector<std::string> names;
  for (const auto& item : whole.tensors) names.push_back(item.first);
  EXPECT_EQ(reader.names(), names);
  EXPECT_EQ(reader.header().metadata, whole.metadata);
  for (const auto& [name, tensor] : whole.tensors) {
    SCOPED_TRACE(name);
    EXPECT_EQ(reader.scalarType(name), tensor.scalar_type());
    EXPECT_TRUE(sameTensor(reader.read(name), tensor));
    const at::Tensor flat = tensor.reshape({-1});
    for (int64_t begin = 0; begin <= flat.numel(); ++begin) {
      for (int64_t count = 0; begin + count <= flat.numel(); ++count) {
        ASSERT_TRUE(
            sameTensor(reader.readRange(name, begin, count), flat.slice(0, begin, begin + count)))
            << begin << "+" << count;
      }
    }
  }
  at::Tensor into = at::empty({2, 2}, at::kFloat);  // any shape with the right numel
  reader.readRangeInto("t0", 5, into);
  EXPECT_TRUE(into.reshape({-1}).equal(whole.at("t0").reshape({-1}).slice(0, 5, 9)));
}

TEST(TensorFileReaderTest, RefusesUnknownNamesAndBadRanges) {
  testing::TempDir dir;
  const std::string path = dir.file("named.safetensors");
  writeTensorFile(path, sampleFile());
  const TensorFileReader reader(path);
  EXPECT_THROW(reader.readRange("missing", 0, 1), c10::IndexError);
  try {
    reader.read("missing");
  } catch (const c10::IndexError& error) {
    EXPECT_NE(std::string(error.what_without_backtrace()).find("named.safetensors"),
              std::string::npos);
  }
  EXPECT_FALSE(reader.contains("missing"));
  EXPECT_TRUE(reader.contains("t1"));
  EXPECT_VALUE_ERROR(reader.readRange("t1", 10, 4), "'t1' has 13 elements");
  EXPECT_VALUE_ERROR(reader.readRange("t1", -1, 2), "outside");
  EXPECT_VALUE_ERROR(reader.readRange("t1", 14, 0), "outside");
  EXPECT_VALUE_ERROR(reader.readRange("t1", 0, -1), "negative count");
  EXPECT_VALUE_ERROR(reader.readRange("t1", 2, INT64_MAX), "outside");
  EXPECT_VALUE_ERROR(reader.readRangeInto("t1", 0, at::empty({3}, at::kFloat)), "BFloat16");
  EXPECT_VALUE_ERROR(reader.readRangeInto("t1", 0, at::empty({3, 2}, at::kBFloat16).t()),
                     "not contiguous");
  EXPECT_EQ(reader.readRange("t1", 13, 0).numel(), 0);
}

TEST(TensorFileReaderTest, RefusesMissingTruncatedAndCorruptFiles) {
  testing::TempDir dir;
  const std::string good = dir.file("good.safetensors");
  writeTensorFile(good, sampleFile());
  const std::string bytes = testing::readFileBytes(good);
  EXPECT_VALUE_ERROR(TensorFileReader(dir.file("missing.safetensors")), "missing.safetensors");
  EXPECT_VALUE_ERROR(TensorFileReader(dir.path()), "not a regular file");
  for (size_t keep : {size_t{0}, size_t{5}, size_t{8}, size_t{40}, bytes.size() - 1}) {
    const std::string path = dir.file("cut" + std::to_string(keep) + ".safetensors");
    testing::writeFileBytes(path, bytes.substr(0, keep));
    EXPECT_VALUE_ERROR(TensorFileReader{path}, path);
  }
  std::string corrupt = bytes;
  corrupt[12] = '#';  // inside the JSON header
  testing::writeFileBytes(dir.file("corrupt.safetensors"), corrupt);
  EXPECT_VALUE_ERROR(TensorFileReader(dir.file("corrupt.safetensors")), "corrupt.safetensors");
  std::string longer = bytes + "extra";  // data area not covered by tensors
  testing::writeFileBytes(dir.file("longer.safetensors"), longer);
  EXPECT_VALUE_ERROR(TensorFileReader(dir.file("longer.safetensors")), "longer.safetensors");
}

TEST(TensorFileReaderTest, ReportsFileShrunkAfterOpenAndBadBools) {
  testing::TempDir dir;
  const std::string path = dir.file("shrinks.safetensors");
  writeTensorFile(path, sampleFile());
  const TensorFileReader reader(path);
  const uint64_t size = fs::file_size(path);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(size - 20)), 0);
  EXPECT_VALUE_ERROR(reader.read("t10"), "truncated");

  writeTensorFile(path, sampleFile());
  const TensorFileReader fresh(path);
  const TensorEntry& entry = fresh.entry("t6");  // BOOL, 9 elements
  std::string bytes = testing::readFileBytes(path);
  bytes[fresh.header().dataOffset + entry.begin + 4] = 7;
  testing::writeFileBytes(path, bytes);
  const TensorFileReader reader2(path);
  EXPECT_VALUE_ERROR(reader2.readRange("t6", 2, 5), "BOOL element 4 is byte 7");
  EXPECT_EQ(reader2.readRange("t6", 5, 4).numel(), 4);  // the rest is fine
}

TEST(TensorFileReaderTest, ThreadsShareOneReader) {
  testing::TempDir dir;
  const std::string path = dir.file("shared.safetensors");
  TensorFile file;
  file.tensors.emplace_back("big", at::arange(1 << 18, at::kFloat));
  file.tensors.emplace_back("half", at::arange(1000, at::kDouble).to(at::kBFloat16));
  writeTensorFile(path, file);
  const TensorFileReader reader(path);
  std::vector<int> failures(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(t);
      for (int i = 0; i < 200; ++i) {
        const char* name = i % 2 ? "big" : "half";
        const int64_t numel = file.at(name).numel();
        const int64_t begin = random() % numel;
        const int64_t count = random() % (numel - begin + 1);
        if (!reader.readRange(name, begin, count)
                 .equal(file.at(name).slice(0, begin, begin + count))) {
          ++failures[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace shardema
