// The collective paths over real Gloo (ranks as threads): the online save
// writes the same checkpoint the file-level API does, and the streaming
// exportWeights writes the same bytes as the offline export of that checkpoint.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <mutex>

#include "lib/sharded_fixture.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kWorld = 3;
constexpr int64_t kSteps = 5;

// Rank `rank`'s own model and averager, stepped kSteps times.
std::unique_ptr<ShardedAverager> trainedRank(const std::vector<testing::ModelTensor>& model,
                                             int64_t rank, std::vector<at::Tensor>& tensors) {
  tensors = testing::makeModel(model, 0);
  auto averager = std::make_unique<ShardedAverager>(
      rank, kWorld,
      shardsFromFullTensors(testing::trackedModel(model, tensors), shard::LayoutKind::kFsdp2, rank,
                            kWorld),
      testing::smallChunkOptions());
  for (int64_t step = 1; step <= kSteps; ++step) {
    testing::setModel(model, tensors, step);
    averager->update(step);
    averager->fence();
  }
  return averager;
}

TEST(ShardedOnlineTest, OnlineSaveAndStreamingExportMatchTheOfflineTools) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kBFloat16, true);
  testing::PerTensorJob job(model, shard::LayoutKind::kFsdp2, 1);
  job.run(1, kSteps);
  std::mutex mutex;
  std::vector<std::pair<std::string, at::Tensor>> gathered;
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const auto averager = trainedRank(model, comm.rank(), tensors);
    saveCheckpoint(comm, dir.file("ckpt"), *averager);
    shard::GatherOptions small;
    small.bufferBytes = 40;
    averager->exportWeights(comm, dir.file("online.safetensors"), at::kBFloat16, small);
    auto full = averager->fullStateDict(comm, small);
    std::lock_guard<std::mutex> lock(mutex);
    if (comm.rank() == 0) gathered = std::move(full);
  });
  ASSERT_EQ(gathered.size(), model.size());
  for (const auto& [name, tensor] : gathered) {
    EXPECT_TRUE(testing::sameTensor(tensor, job.reference.ema(name))) << name;
  }
  const RankManifest manifest = inspectCheckpoint(dir.file("ckpt"));
  EXPECT_EQ(manifest.worldSize(), kWorld);
  EXPECT_EQ(manifest.step, kSteps);
  ExportOptions bf16;
  bf16.outputDtype = at::kBFloat16;
  exportCheckpoint(dir.file("ckpt"), dir.file("offline.safetensors"), bf16);
  EXPECT_EQ(testing::readFileBytes(dir.file("online.safetensors")),
            testing::readFileBytes(dir.file("offline.safetensors")));
}

// Runs the online save on every rank, rank `bad` with another rank's
// averager (a mismatch it finds before writing); returns each rank's error
// and checks that the failure came fast, not by the 20 s timeout.
std::vector<std::string> saveWithBadRank(const std::vector<testing::ModelTensor>& model,
                                         const std::string& ckpt, int64_t bad) {
  std::mutex mutex;
  std::vector<std::string> errors(kWorld);
  const auto start = std::chrono::steady_clock::now();
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const int64_t rank = comm.rank() == bad ? (bad + 1) % kWorld : comm.rank();
    const auto averager = trainedRank(model, rank, tensors);
    try {
      saveCheckpoint(comm, ckpt, *averager);
    } catch (const c10::Error& error) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[comm.rank()] = error.what_without_backtrace();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  return errors;
}

TEST(ShardedOnlineTest, AFailedSaveFailsEveryRankAndKeepsThePreviousCheckpoint) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kFloat, false);
  const std::string ckpt = dir.file("ckpt");
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    saveCheckpoint(comm, ckpt, *trainedRank(model, comm.rank(), tensors));
  });
  const RankManifest before = inspectCheckpoint(ckpt);
  const std::string manifestBytes = testing::readFileBytes(ckpt + "/manifest.json");
  std::vector<std::string> rankBytes;
  for (const RankFileRecord& record : before.files) {
    rankBytes.push_back(testing::readFileBytes(ckpt + "/" + record.name));
  }
  for (int64_t bad : {1, 0}) {
    const std::vector<std::string> errors = saveWithBadRank(model, ckpt, bad);
    EXPECT_NE(errors[bad].find("communicator is rank " + std::to_string(bad)), std::string::npos)
        << errors[bad];
    for (int64_t r = 0; r < kWorld; ++r) {
      if (r == bad) continue;
      EXPECT_NE(errors[r].find("no checkpoint was written"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("rank " + std::to_string(bad)), std::string::npos) << errors[r];
    }
    // The previous checkpoint is still there, byte for byte, and loads.
    EXPECT_EQ(testing::readFileBytes(ckpt + "/manifest.json"), manifestBytes);
    const RankManifest after = inspectCheckpoint(ckpt);
    for (size_t r = 0; r < after.files.size(); ++r) {
      EXPECT_EQ(testing::readFileBytes(ckpt + "/" + after.files[r].name), rankBytes[r]);
    }
    std::vector<at::Tensor> tensors;
    const auto fresh = std::make_unique<ShardedAverager>(
        0, kWorld,
        shardsFromFullTensors(testing::trackedModel(model, tensors = testing::makeModel(model, 0)),
                              shard::LayoutKind::kFsdp2, 0, kWorld),
        testing::smallChunkOptions());
    loadCheckpoint(ckpt, *fresh);
    EXPECT_EQ(fresh->step(), kSteps);
  }
  // A save that succeeds afterwards removes the files the old one named.
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    saveCheckpoint(comm, ckpt, *trainedRank(model, comm.rank(), tensors));
  });
  const RankManifest latest = inspectCheckpoint(ckpt);
  size_t files = 0;
  for (const auto& entry : fs::directory_iterator(ckpt)) files += entry.is_regular_file();
  EXPECT_EQ(files, static_cast<size_t>(kWorld) + 1);
  EXPECT_NE(latest.files[0].name, before.files[0].name);
}

TEST(ShardedOnlineTest, RankZeroThatCannotCreateTheFolderFailsEveryRankPromptly) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kFloat, false);
  testing::writeFileBytes(dir.file("file"), "x");  // a file where a folder must go
  std::mutex mutex;
  std::vector<std::string> errors(kWorld);
  const auto start = std::chrono::steady_clock::now();
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const auto averager = trainedRank(model, comm.rank(), tensors);
    try {
      saveCheckpoint(comm, dir.file("file/ckpt"), *averager);
    } catch (const c10::Error& error) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[comm.rank()] = error.what_without_backtrace();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  for (int64_t r = 0; r < kWorld; ++r) {
    EXPECT_NE(errors[r].find("rank 0"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("no checkpoint was written"), std::string::npos) << errors[r];
  }
}

TEST(ShardedOnlineTest, ARootThatCannotWriteTheExportFailsEveryRank) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kFloat, false);
  // A non-empty folder at the path: rank 0 refuses to replace it when it
  // opens the output (it used to fail only at the final rename).
  fs::create_directories(dir.file("taken/inside"));
  std::mutex mutex;
  std::vector<std::string> errors(kWorld);
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const auto averager = trainedRank(model, comm.rank(), tensors);
    try {
      averager->exportWeights(comm, dir.file("taken"));
    } catch (const c10::Error& error) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[comm.rank()] = error.what_without_backtrace();
    }
  });
  EXPECT_NE(errors[0].find("taken"), std::string::npos) << errors[0];
  for (int64_t r = 1; r < kWorld; ++r) {
    EXPECT_NE(errors[r].find("rank 0 could not"), std::string::npos) << errors[r];
  }
  EXPECT_TRUE(fs::is_directory(dir.file("taken/inside")));
}

TEST(ShardedOnlineTest, AnAveragerWithoutShardsTakesItsWorldSize) {
  const ShardedAverager empty(2, kWorld, {});
  EXPECT_EQ(empty.worldSize(), kWorld);
  EXPECT_EQ(empty.rank(), 2);
  EXPECT_THROW(ShardedAverager(kWorld, kWorld, {}), c10::ValueError);
  const shard::ShardSpec spec = shard::fsdp2Spec("w", {4}, at::kFloat, 2);
  EXPECT_THROW(ShardedAverager(0, kWorld, {{at::zeros({2}), spec}}), c10::ValueError);
}

}  // namespace
}  // namespace shardema
