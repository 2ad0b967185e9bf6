// TensorFolderWriter: huggingface_hub's split (its docstring's example, a
// tensor over the limit in a file of its own), the files and the index read
// back, the set published only when whole (a failure or a missing tensor
// leaves the old export as it was), stale files of an earlier export
// removed, and bad input refused before anything is written.
// tests/python/test_hf_export.py checks the same files against
// huggingface_hub, transformers and safetensors themselves.
#include "shardema/core/tensor_folder_writer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/core/tensor_file.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/value_error.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

// An entry of `bytes` bytes: a 1-D uint8 tensor.
TensorFileEntry bytesEntry(const std::string& name, int64_t bytes) {
  return {name, at::kByte, {bytes}};
}

std::vector<TensorFileEntry> sizedEntries(const std::vector<int64_t>& sizes) {
  std::vector<TensorFileEntry> entries;
  for (size_t i = 0; i < sizes.size(); ++i) {
    entries.push_back(bytesEntry("t" + std::to_string(i), sizes[i]));
  }
  return entries;
}

TEST(TensorFolderWriterTest, SplitsAsHuggingFaceHubDoes) {
  // split_state_dict_into_shards' docstring: [6, 6, 2, 6, 2, 2] GB under
  // 10 GB give [6], [6 + 2], [6 + 2 + 2].
  EXPECT_EQ(splitTensorFiles(sizedEntries({6, 6, 2, 6, 2, 2}), 10),
            (std::vector<std::vector<size_t>>{{0}, {1, 2}, {3, 4, 5}}));
  // A tensor over the limit gets a file of its own where it is met; the
  // file being filled goes on after it (so it comes later).
  EXPECT_EQ(splitTensorFiles(sizedEntries({1, 10, 1, 4}), 5),
            (std::vector<std::vector<size_t>>{{1}, {0, 2}, {3}}));
  // Exactly the limit fits; empty tensors cost nothing.
  EXPECT_EQ(splitTensorFiles(sizedEntries({5, 0, 5}), 5),
            (std::vector<std::vector<size_t>>{{0, 1}, {2}}));
  EXPECT_EQ(splitTensorFiles({}, 5), (std::vector<std::vector<size_t>>{{}}));
  EXPECT_VALUE_ERROR(splitTensorFiles(sizedEntries({1}), 0), "maxFileBytes must be >= 1");
  EXPECT_EQ(tensorFolderFileName(0, 1), "model.safetensors");
  EXPECT_EQ(tensorFolderFileName(1, 3), "model-00002-of-00003.safetensors");
}

// Tensors whose values encode their name and index.
std::vector<std::pair<std::string, at::Tensor>> sampleTensors() {
  return {{"emb.weight", at::arange(24, at::kFloat).view({4, 6})},
          {"big", at::arange(100, at::kFloat) + 1000},
          {"empty", at::zeros({0, 3}, at::kFloat)},
          {"head.weight", at::arange(24, at::kFloat).view({4, 6})},  // a tied copy
          {"steps", at::arange(3, at::kLong)},
          {"scale", at::full({}, 0.5, at::kBFloat16)}};
}

std::vector<TensorFileEntry> entriesOf(const std::vector<std::pair<std::string, at::Tensor>>& all) {
  std::vector<TensorFileEntry> entries;
  for (const auto& [name, tensor] : all) {
    entries.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  return entries;
}

// Writes `all` in pieces of at most 7 elements.
void writeAll(TensorFolderWriter& writer, const std::vector<std::pair<std::string, at::Tensor>>& all) {
  for (const auto& [name, tensor] : all) {
    const at::Tensor flat = tensor.reshape({-1});
    for (int64_t at = 0; at < flat.numel(); at += 7) {
      writer.append(flat.slice(0, at, std::min<int64_t>(at + 7, flat.numel())));
    }
  }
}

nlohmann::json readIndex(const std::string& folder) {
  return nlohmann::json::parse(testing::readFileBytes(folder + "/" + kModelIndexFileName));
}

TEST(TensorFolderWriterTest, WritesFilesAndAnIndexThatNameEveryTensor) {
  testing::TempDir dir;
  const std::string folder = dir.file("export");
  const auto all = sampleTensors();
  // emb 96 bytes, big 400 (over the limit), head 96, steps 24, scale 2.
  TensorFolderWriter writer(folder, entriesOf(all), {{"format", "pt"}}, 150);
  EXPECT_EQ(writer.fileNames(),
            (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                      "model-00002-of-00003.safetensors",
                                      "model-00003-of-00003.safetensors"}));
  writeAll(writer, all);
  EXPECT_FALSE(fs::exists(folder + "/" + kModelIndexFileName));  // not before commit
  EXPECT_FALSE(fs::exists(folder + "/model-00001-of-00003.safetensors"));
  writer.commit();
  const nlohmann::json index = readIndex(folder);
  EXPECT_EQ(index["metadata"]["total_size"], 96 + 400 + 0 + 96 + 24 + 2);
  EXPECT_EQ(writer.totalTensorBytes(), 618u);
  const nlohmann::json expected = {{"big", "model-00001-of-00003.safetensors"},
                                   {"emb.weight", "model-00002-of-00003.safetensors"},
                                   {"empty", "model-00002-of-00003.safetensors"},
                                   {"head.weight", "model-00003-of-00003.safetensors"},
                                   {"steps", "model-00003-of-00003.safetensors"},
                                   {"scale", "model-00003-of-00003.safetensors"}};
  EXPECT_EQ(index["weight_map"], expected);
  uint64_t fileBytes = 0;
  for (const auto& [name, tensor] : all) {
    const std::string file = folder + "/" + index["weight_map"][name].get<std::string>();
    const TensorFile read = readTensorFile(file);  // checks the tensor checksums too
    EXPECT_TRUE(read.at(name).equal(tensor)) << name;
    EXPECT_EQ(read.metadata.at("format"), "pt");
  }
  for (const std::string& name : writer.fileNames()) fileBytes += fs::file_size(folder + "/" + name);
  EXPECT_EQ(writer.totalFileBytes(), fileBytes);
  for (const auto& entry : fs::directory_iterator(folder)) {
    EXPECT_EQ(entry.path().extension() == ".tmp", false) << entry.path();
  }
}

TEST(TensorFolderWriterTest, OneFileWhenAllFitAndNoIndex) {
  testing::TempDir dir;
  const std::string folder = dir.file("export");
  const auto all = sampleTensors();
  TensorFolderWriter writer(folder, entriesOf(all), {}, int64_t{1} << 30);
  writeAll(writer, all);
  writer.commit();
  EXPECT_EQ(writer.fileNames(), std::vector<std::string>{kModelWeightsFileName});
  EXPECT_FALSE(fs::exists(folder + "/" + kModelIndexFileName));
  const TensorFile read = readTensorFile(folder + "/" + kModelWeightsFileName);
  ASSERT_EQ(read.tensors.size(), all.size());
  for (const auto& [name, tensor] : all) EXPECT_TRUE(read.at(name).equal(tensor)) << name;
}

// A folder with an earlier export of another shape: its files no new index
// names would mislead a reader (model.safetensors is read before an index).
void writeEarlierExport(const std::string& folder) {
  fs::create_directories(folder);
  for (const char* name : {"model-00001-of-00004.safetensors", "model-00004-of-00004.safetensors",
                           "model.safetensors", "model.safetensors.index.json"}) {
    testing::writeFileBytes(folder + "/" + name, "earlier");
  }
  testing::writeFileBytes(folder + "/config.json", "{}");
  testing::writeFileBytes(folder + "/model-notes.txt", "mine");
}

TEST(TensorFolderWriterTest, ReplacesAnEarlierExportAndKeepsOtherFiles) {
  testing::TempDir dir;
  const std::string folder = dir.file("export");
  writeEarlierExport(folder);
  const auto all = sampleTensors();
  {
    TensorFolderWriter writer(folder, entriesOf(all), {}, 150);
    writeAll(writer, all);
    writer.commit();
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{
                       "config.json", "model-00001-of-00003.safetensors",
                       "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                       "model-notes.txt", "model.safetensors.index.json"}));
  // And a one-file export over that split one removes its index and files.
  {
    TensorFolderWriter writer(folder, entriesOf(all), {}, int64_t{1} << 30);
    writeAll(writer, all);
    writer.commit();
  }
  names.clear();
  for (const auto& entry : fs::directory_iterator(folder)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"config.json", "model-notes.txt", "model.safetensors"}));
}

TEST(TensorFolderWriterTest, AnUnfinishedExportLeavesTheEarlierOneAsItWas) {
  testing::TempDir dir;
  const std::string folder = dir.file("export");
  writeEarlierExport(folder);
  const auto all = sampleTensors();
  {
    TensorFolderWriter writer(folder, entriesOf(all), {}, 150);
    writer.append(all[0].second.reshape({-1}));  // emb, then big: two files touched
    writer.append(all[1].second.reshape({-1}).slice(0, 0, 50));
    EXPECT_VALUE_ERROR(writer.commit(), "tensor 'big' has 50 of its 100 elements");
  }  // destroyed: a failed gather, a dead rank
  for (const char* name : {"model-00001-of-00004.safetensors", "model-00004-of-00004.safetensors",
                           "model.safetensors", "model.safetensors.index.json"}) {
    EXPECT_EQ(testing::readFileBytes(folder + "/" + name), "earlier") << name;
  }
  for (const auto& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    EXPECT_EQ(name.find("of-00003"), std::string::npos) << name;
  }
}

TEST(TensorFolderWriterTest, RefusesBadInputBeforeWritingAnything) {
  testing::TempDir dir;
  const std::string folder = dir.file("export");
  EXPECT_VALUE_ERROR(TensorFolderWriter(folder, {bytesEntry("a", 4), bytesEntry("a", 4)}, {}, 4),
                     "tensor 'a' is given twice");  // in two files
  EXPECT_VALUE_ERROR(TensorFolderWriter(folder, {bytesEntry("", 4)}, {}, 4), "");
  EXPECT_VALUE_ERROR(
      TensorFolderWriter(folder, {bytesEntry("a", 4)}, {{"shardema.format", "7"}}, 4),
      "shardema.format");
  EXPECT_VALUE_ERROR(TensorFolderWriter(folder, sizedEntries({1, 1}), {}, 0),
                     "maxFileBytes must be >= 1");
  EXPECT_FALSE(fs::exists(folder));
  testing::writeFileBytes(dir.file("a_file"), "x");
  EXPECT_VALUE_ERROR(TensorFolderWriter(dir.file("a_file"), sizedEntries({1}), {}, 4),
                     "exists and is not a folder");
  TensorFolderWriter writer(folder, sizedEntries({2, 2}), {}, 3);
  EXPECT_VALUE_ERROR(writer.append(at::zeros({2}, at::kFloat)), "tensor 't0' is Byte");
  EXPECT_VALUE_ERROR(writer.append(at::zeros({3}, at::kByte)), "lacks 2 of its 2 elements");
  writer.append(at::zeros({2}, at::kByte));
  writer.append(at::ones({2}, at::kByte));
  EXPECT_VALUE_ERROR(writer.append(at::zeros({1}, at::kByte)), "every tensor is complete");
  writer.commit();
  EXPECT_TRUE(readTensorFile(folder + "/model-00002-of-00002.safetensors")
                  .at("t1")
                  .equal(at::ones({2}, at::kByte)));
}

}  // namespace
}  // namespace shardema
