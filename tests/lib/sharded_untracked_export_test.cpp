// exportWeights' untracked tensors (UntrackedTensor: the model's own values
// of what the EMA leaves out) over real Gloo (ranks as threads): the root
// writes each right before the EMA tensor it names, or after the last, into
// one file or a split folder, a piece at a time (several pieces per tensor
// here), floating ones as the export's dtype; names listed under
// shardema.from_model. A bad one fails every rank before anything is written.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>

#include "lib/sharded_fixture.h"
#include "shardema/core/file_metadata.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_folder_writer.h"
#include "shardema/sharded_averager.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kWorld = 3;
constexpr int64_t kSteps = 4;

std::unique_ptr<ShardedAverager> trainedRank(const std::vector<testing::ModelTensor>& model,
                                             int64_t rank, std::vector<at::Tensor>& tensors) {
  tensors = testing::makeModel(model, 0);
  auto averager = std::make_unique<ShardedAverager>(
      rank, kWorld,
      shardsFromFullTensors(testing::trackedModel(model, tensors), shard::LayoutKind::kFsdp2,
                            rank, kWorld),
      testing::smallChunkOptions());
  for (int64_t step = 1; step <= kSteps; ++step) {
    testing::setModel(model, tensors, step);
    averager->update(step);
    averager->fence();
  }
  return averager;
}

// The model's own tensors: one before the first EMA tensor, a float64 one
// stored transposed and an integer one before "big", a large one (many
// 40-byte pieces) and an empty one after the last.
std::vector<UntrackedTensor> untrackedTensors() {
  return {
      {"frozen_first", at::arange(6, at::kFloat).reshape({2, 3}) + 0.5, "empty"},
      {"frozen_mid", at::arange(12, at::kDouble).reshape({3, 4}).t() * 0.25, "big"},
      {"frozen_int", at::arange(5, at::kLong) * 7, "big"},
      {"frozen_last", at::linspace(-1.0, 1.0, 101, at::kFloat), ""},
      {"frozen_empty", at::empty({0, 4}, at::kFloat), ""},
  };
}

// The export's names and expected values in file order.
std::vector<std::pair<std::string, at::Tensor>> expectedOrder(
    const std::vector<testing::ModelTensor>& model, const testing::PerTensorJob& job) {
  const std::vector<UntrackedTensor> untracked = untrackedTensors();
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto asWritten = [](const at::Tensor& t) {
    return at::isFloatingType(t.scalar_type()) ? t.to(at::kFloat).contiguous() : t;
  };
  for (const testing::ModelTensor& tensor : model) {
    for (const UntrackedTensor& u : untracked) {
      if (u.before == tensor.name) out.emplace_back(u.name, asWritten(u.value));
    }
    out.emplace_back(tensor.name, asWritten(job.reference.ema(tensor.name)));
  }
  for (const UntrackedTensor& u : untracked) {
    if (u.before.empty()) out.emplace_back(u.name, asWritten(u.value));
  }
  return out;
}

void expectFromModel(const std::map<std::string, std::string>& metadata) {
  ASSERT_TRUE(metadata.count(detail::kFromModelKey));
  EXPECT_EQ(nlohmann::json::parse(metadata.at(detail::kFromModelKey)),
            nlohmann::json({"frozen_empty", "frozen_first", "frozen_int", "frozen_last",
                            "frozen_mid"}));
}

TEST(ShardedUntrackedExportTest, TheRootWritesThemWhereTheyBelongInAFileAndAFolder) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kBFloat16, true);
  testing::PerTensorJob job(model, shard::LayoutKind::kFsdp2, 1);
  job.run(1, kSteps);
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const auto averager = trainedRank(model, comm.rank(), tensors);
    shard::GatherOptions small;
    small.bufferBytes = 40;
    // Only the root's are read: the others pass none.
    const std::vector<UntrackedTensor> untracked =
        comm.rank() == 0 ? untrackedTensors() : std::vector<UntrackedTensor>{};
    averager->exportWeights(comm, dir.file("one.safetensors"), at::kFloat, small, std::nullopt,
                            0, untracked);
    averager->exportWeights(comm, dir.file("split"), at::kFloat, small, 100, 0, untracked);
  });
  const auto expected = expectedOrder(model, job);
  const TensorFile one = readTensorFile(dir.file("one.safetensors"));
  ASSERT_EQ(one.tensors.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(one.tensors[i].first, expected[i].first);
    EXPECT_TRUE(testing::sameTensor(one.tensors[i].second, expected[i].second))
        << expected[i].first;
  }
  expectFromModel(one.metadata);
  // The folder: huggingface_hub's split of the same entries in the same order.
  std::vector<TensorFileEntry> entries;
  for (const auto& [name, value] : expected) {
    entries.push_back({name, value.scalar_type(), value.sizes().vec()});
  }
  const auto files = splitTensorFiles(entries, 100);
  ASSERT_GT(files.size(), 3u);
  const nlohmann::json index =
      nlohmann::json::parse(testing::readFileBytes(dir.file("split/model.safetensors.index.json")));
  for (size_t f = 0; f < files.size(); ++f) {
    const std::string name = tensorFolderFileName(f, files.size());
    const TensorFile file = readTensorFile(dir.file("split/" + name));
    expectFromModel(file.metadata);
    ASSERT_EQ(file.tensors.size(), files[f].size()) << name;
    for (size_t k = 0; k < files[f].size(); ++k) {
      const auto& [want, value] = expected[files[f][k]];
      EXPECT_EQ(file.tensors[k].first, want) << name;
      EXPECT_EQ(index["weight_map"][want], name) << want;
      EXPECT_TRUE(testing::sameTensor(file.tensors[k].second, value)) << want;
    }
  }
}

TEST(ShardedUntrackedExportTest, ABadOneFailsEveryRankAndWritesNothing) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kFloat, false);
  const at::Tensor value = at::ones({2}, at::kFloat);
  for (const UntrackedTensor& bad : {UntrackedTensor{"x", value, "nope"},
                                     UntrackedTensor{"big", value, ""},
                                     UntrackedTensor{"y", at::Tensor(), ""}}) {
    std::mutex mutex;
    std::vector<std::string> errors(kWorld);
    testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
      std::vector<at::Tensor> tensors;
      const auto averager = trainedRank(model, comm.rank(), tensors);
      const std::vector<UntrackedTensor> untracked =
          comm.rank() == 0 ? std::vector<UntrackedTensor>{bad} : std::vector<UntrackedTensor>{};
      try {
        averager->exportWeights(comm, dir.file("out"), at::kFloat, {}, 64, 0, untracked);
      } catch (const c10::Error& error) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[comm.rank()] = error.what_without_backtrace();
      }
    });
    EXPECT_NE(errors[0].find("'" + bad.name + "'"), std::string::npos) << errors[0];
    for (int64_t r = 1; r < kWorld; ++r) {
      EXPECT_NE(errors[r].find("rank 0 could not"), std::string::npos) << errors[r];
    }
    EXPECT_FALSE(fs::exists(dir.file("out/model.safetensors.index.json")));
    EXPECT_TRUE(!fs::exists(dir.file("out")) || fs::is_empty(dir.file("out"))) << bad.name;
  }
}

}  // namespace
}  // namespace shardema
