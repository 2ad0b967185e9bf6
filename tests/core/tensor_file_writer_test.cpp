// TensorFileWriter: the bytes equal writeTensorFile's for the same tensors
// whatever the piece split, the checksum equals the file's, numpy reads a
// streamed file, bad pieces are refused naming the tensor, and nothing
// replaces the target until commit().
#include "shardema/core/tensor_file_writer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "shardema/core/checksum.h"
#include "shardema/core/tensor_file.h"
#include "support/command_output.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/tensor_file_rows.h"
#include "support/value_error.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

TensorFile sampleFile() {
  TensorFile file = testing::everyDtypeFile();
  file.metadata = {{"shardema.kind", "test"}, {"note", "streamed"}};
  return file;
}

std::vector<TensorFileEntry> entriesOf(const TensorFile& file) {
  std::vector<TensorFileEntry> entries;
  for (const auto& [name, tensor] : file.tensors) {
    entries.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  return entries;
}

// Streams every tensor of `file` in random-sized pieces.
uint64_t streamFile(const std::string& path, const TensorFile& file, std::mt19937& random) {
  TensorFileWriter writer(path, entriesOf(file), file.metadata);
  for (const auto& [name, tensor] : file.tensors) {
    const at::Tensor flat = tensor.reshape({-1});
    int64_t at = 0;
    while (at < flat.numel()) {
      const int64_t step = std::min<int64_t>(flat.numel() - at, random() % 6);  // 0 included
      writer.append(flat.slice(0, at, at + step));
      at += step;
    }
  }
  EXPECT_EQ(writer.currentTensor(), "");
  writer.commit();
  EXPECT_EQ(writer.fileSize(), fs::file_size(path));
  return writer.checksum();
}

TEST(TensorFileWriterTest, BytesEqualWriteTensorFileForAnySplit) {
  testing::TempDir dir;
  const TensorFile file = sampleFile();
  writeTensorFile(dir.file("whole.safetensors"), file);
  const std::string expected = testing::readFileBytes(dir.file("whole.safetensors"));
  std::mt19937 random(3);
  for (int trial = 0; trial < 20; ++trial) {
    const std::string path = dir.file("streamed.safetensors");
    const uint64_t checksum = streamFile(path, file, random);
    ASSERT_EQ(testing::readFileBytes(path), expected) << "trial " << trial;
    EXPECT_EQ(checksum, fileChecksum(path));
    EXPECT_EQ(checksum, xxh64(expected.data(), expected.size()));
  }
  // An empty file (no tensors) too.
  TensorFile none;
  writeTensorFile(dir.file("none0.safetensors"), none);
  TensorFileWriter writer(dir.file("none1.safetensors"), {});
  writer.commit();
  EXPECT_EQ(testing::readFileBytes(dir.file("none1.safetensors")),
            testing::readFileBytes(dir.file("none0.safetensors")));
}

TEST(TensorFileWriterTest, RefusesBadPiecesNamingTheTensor) {
  testing::TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  TensorFileWriter writer(path, {{"a.weight", at::kFloat, {2, 3}}, {"b.bias", at::kBFloat16, {4}}});
  EXPECT_VALUE_ERROR(writer.append(at::zeros({2}, at::kDouble)), "a.weight");
  EXPECT_VALUE_ERROR(writer.append(at::zeros({7}, at::kFloat)), "a.weight' lacks 6");
  EXPECT_VALUE_ERROR(writer.append(at::zeros({4, 2}, at::kFloat).t()), "contiguous");
  EXPECT_VALUE_ERROR(writer.append(at::Tensor()), "undefined");
  writer.append(at::zeros({4}, at::kFloat));
  EXPECT_EQ(writer.remainingInCurrent(), 2);
  // A piece never spans two tensors: 2 left in a.weight, 3 given.
  EXPECT_VALUE_ERROR(writer.append(at::zeros({3}, at::kFloat)), "a.weight' lacks 2");
  writer.append(at::zeros({2}, at::kFloat));
  EXPECT_EQ(writer.currentTensor(), "b.bias");
  EXPECT_VALUE_ERROR(writer.append(at::zeros({1}, at::kFloat)), "b.bias' is BFloat16");
  writer.append(at::zeros({1}, at::kBFloat16));
  EXPECT_VALUE_ERROR(writer.commit(), "b.bias' has 1 of its 4 elements");
  writer.append(at::zeros({3}, at::kBFloat16));
  EXPECT_VALUE_ERROR(writer.append(at::zeros({1}, at::kBFloat16)), "every tensor is complete");
  EXPECT_THROW(writer.checksum(), c10::Error);  // before commit
  writer.commit();
  EXPECT_EQ(writer.checksum(), fileChecksum(path));
  EXPECT_THROW(writer.commit(), c10::Error);
}

TEST(TensorFileWriterTest, RefusesBadEntriesBeforeCreatingAnything) {
  testing::TempDir dir;
  const std::string path = dir.file("x.safetensors");
  EXPECT_VALUE_ERROR(TensorFileWriter(path, {{"dup", at::kFloat, {1}}, {"dup", at::kFloat, {2}}}),
                     "dup");
  EXPECT_VALUE_ERROR(TensorFileWriter(path, {{"neg", at::kFloat, {-1}}}), "neg");
  EXPECT_THROW(TensorFileWriter(path, {{"complex", at::kComplexFloat, {1}}}), c10::TypeError);
  EXPECT_VALUE_ERROR(TensorFileWriter(path, {}, {{"shardema.format", "2"}}), "shardema.format");
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(TensorFileWriterTest, NoCommitLeavesOldFileIntact) {
  testing::TempDir dir;
  const std::string path = dir.file("model.safetensors");
  testing::writeFileBytes(path, "old file");
  {
    TensorFileWriter writer(path, {{"w", at::kFloat, {4}}});
    writer.append(at::ones({2}, at::kFloat));
    EXPECT_TRUE(fs::exists(path + ".tmp"));
    EXPECT_EQ(testing::readFileBytes(path), "old file");
  }
  EXPECT_EQ(testing::readFileBytes(path), "old file");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  {
    TensorFileWriter writer(path, {{"w", at::kFloat, {4}}});
    writer.append(at::ones({4}, at::kFloat));
    // Complete but not committed (e.g. an exception later in the export).
  }
  EXPECT_EQ(testing::readFileBytes(path), "old file");
  const std::string fresh = dir.file("fresh.safetensors");
  { TensorFileWriter writer(fresh, {{"w", at::kFloat, {4}}}); }
  EXPECT_FALSE(fs::exists(fresh));
  // Moving hands the temp file over; the moved-to writer commits.
  TensorFileWriter first(fresh, {{"w", at::kFloat, {1}}});
  TensorFileWriter second(std::move(first));
  second.append(at::ones({1}, at::kFloat));
  second.commit();
  EXPECT_EQ(readTensorFile(fresh).at("w").item<float>(), 1.0f);
}

// Memory stays at one piece whatever the file size: 64 MiB through one
// 1 MiB piece must not raise the peak RSS by anything near the file size.
int64_t peakRssKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

TEST(TensorFileWriterTest, MemoryIsBoundedByThePiece) {
  testing::TempDir dir;
  const int64_t pieceElements = 256 * 1024;  // 1 MiB of fp32
  const int64_t pieces = 64;
  at::Tensor piece = at::arange(pieceElements, at::kFloat);
  const int64_t before = peakRssKiB();
  ASSERT_GT(before, 0);
  TensorFileWriter writer(dir.file("big.safetensors"),
                          {{"big", at::kFloat, {pieces, pieceElements}}});
  for (int64_t i = 0; i < pieces; ++i) writer.append(piece);
  writer.commit();
  const int64_t grown = peakRssKiB() - before;
  EXPECT_LT(grown, 16 * 1024) << "peak RSS grew by " << grown << " KiB for a 64 MiB file";
  EXPECT_EQ(fs::file_size(dir.file("big.safetensors")), writer.fileSize());
}

// numpy (tests/python/read_safetensors.py) checks a file we streamed. The
// values come from a numpy-written file, so neither side checks itself.
int runPython(const std::string& script, const std::string& path, std::string* output) {
  const testing::CommandResult result = testing::runPythonScript(script, path);
  *output += result.output;
  return result.exitCode;
}

void restream(const TensorFile& source, const std::string& path, const std::string& victim) {
  std::vector<TensorFileEntry> entries;
  for (const auto& [name, tensor] : source.tensors) {
    entries.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  TensorFileWriter writer(path, entries);
  for (const auto& [name, tensor] : source.tensors) {
    at::Tensor flat = tensor.reshape({-1}).clone();
    if (name == victim) flat[1] = flat[0];  // one element wrong
    for (int64_t at = 0; at < flat.numel(); at += 2) writer.append(flat.slice(0, at, at + 2));
  }
  writer.commit();
}

TEST(TensorFileWriterTest, NumpyReadsAStreamedFile) {
  const std::string python = SHARDEMA_TEST_PYTHON;
  testing::TempDir dir;
  std::string output;
  ASSERT_EQ(runPython("write_safetensors.py", dir.file("numpy.safetensors"), &output), 0) << output;
  const TensorFile source = readTensorFile(dir.file("numpy.safetensors"));
  restream(source, dir.file("streamed.safetensors"), "");
  output.clear();
  EXPECT_EQ(runPython("read_safetensors.py", dir.file("streamed.safetensors"), &output), 0)
      << output;
  // The control: the checker notices one wrong element in a streamed file.
  restream(source, dir.file("wrong.safetensors"), "weights.f32");
  output.clear();
  EXPECT_EQ(runPython("read_safetensors.py", dir.file("wrong.safetensors"), &output), 1) << output;
  EXPECT_NE(output.find("weights.f32"), std::string::npos) << output;
}

}  // namespace
}  // namespace shardema
