// The collective paths over real Gloo (ranks as threads): the online save
// writes the same checkpoint the file-level API does, and the streaming
// exportWeights writes the same bytes as the offline export of that checkpoint.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <set>

#include "lib/sharded_fixture.h"
#include "shardema/core/tensor_file.h"
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

using Aliases = std::map<std::string, std::vector<std::string>>;

// Rank `rank`'s own model and averager, stepped kSteps times; `aliases`:
// tied tensors' other names.
std::unique_ptr<ShardedAverager> trainedRank(const std::vector<testing::ModelTensor>& model,
                                             int64_t rank, std::vector<at::Tensor>& tensors,
                                             const Aliases& aliases = {},
                                             const std::set<std::string>& nonPersistent = {}) {
  tensors = testing::makeModel(model, 0);
  std::vector<LocalShard> shards = shardsFromFullTensors(testing::trackedModel(model, tensors),
                                                         shard::LayoutKind::kFsdp2, rank, kWorld);
  for (LocalShard& shard : shards) {
    const auto found = aliases.find(shard.spec.name);
    if (found != aliases.end()) shard.aliases = found->second;
    shard.persistent = nonPersistent.count(shard.spec.name) == 0;
  }
  auto averager = std::make_unique<ShardedAverager>(rank, kWorld, std::move(shards),
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

// A tied tensor (one tensor under several state_dict keys) is written under
// each name, right after its own, with its own bytes: by the streaming
// export (pieces of 40 bytes, so the root assembles it from several), by
// fullStateDict (names asked for may be aliases), and by the offline export
// of the online save, whose manifest records the aliases: the same bytes.
TEST(ShardedOnlineTest, TiedTensorsAreWrittenUnderEveryName) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kBFloat16, true);
  const Aliases aliases = {
      {"big", {"big_tied", "big_too"}}, {"scalar", {"scalar_tied"}}, {"empty", {"empty_tied"}}};
  testing::PerTensorJob job(model, shard::LayoutKind::kFsdp2, 1);
  job.run(1, kSteps);
  std::mutex mutex;
  std::vector<std::pair<std::string, at::Tensor>> gathered, some;
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const auto averager = trainedRank(model, comm.rank(), tensors, aliases);
    EXPECT_EQ(averager->aliases(), aliases);
    saveCheckpoint(comm, dir.file("ckpt"), *averager);
    shard::GatherOptions small;
    small.bufferBytes = 40;
    averager->exportWeights(comm, dir.file("online.safetensors"), at::kFloat, small);
    auto full = averager->fullStateDict(comm, small);
    auto only = averager->fullStateDict(comm, small, std::vector<std::string>{"big_too", "one"});
    std::lock_guard<std::mutex> lock(mutex);
    if (comm.rank() == 0) gathered = std::move(full), some = std::move(only);
  });
  std::vector<std::string> names;
  for (const testing::ModelTensor& tensor : model) {
    names.push_back(tensor.name);
    const auto found = aliases.find(tensor.name);
    if (found != aliases.end())
      names.insert(names.end(), found->second.begin(), found->second.end());
  }
  auto owner = [&](const std::string& name) {
    for (const auto& [tracked, others] : aliases) {
      if (std::find(others.begin(), others.end(), name) != others.end()) return tracked;
    }
    return name;
  };
  const TensorFile online = readTensorFile(dir.file("online.safetensors"));
  ASSERT_EQ(online.tensors.size(), names.size());
  ASSERT_EQ(gathered.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const at::Tensor want = job.reference.ema(owner(names[i]));
    EXPECT_EQ(online.tensors[i].first, names[i]) << "each alias right after its tensor";
    // Floating tensors are written as float32 (a bf16 copy too).
    EXPECT_TRUE(testing::sameTensor(online.tensors[i].second, at::isFloatingType(want.scalar_type())
                                                                  ? want.to(at::kFloat)
                                                                  : want))
        << names[i];
    EXPECT_EQ(gathered[i].first, names[i]);
    EXPECT_TRUE(testing::sameTensor(gathered[i].second, want)) << names[i];
  }
  EXPECT_NE(gathered[9].second.data_ptr(), gathered[10].second.data_ptr()) << "big, big_tied";
  ASSERT_EQ(some.size(), 2u);
  EXPECT_EQ(some[0].first, "one");
  EXPECT_EQ(some[1].first, "big_too");
  EXPECT_TRUE(testing::sameTensor(some[1].second, job.reference.ema("big")));
  EXPECT_EQ(inspectCheckpoint(dir.file("ckpt")).aliases, aliases);
  exportCheckpoint(dir.file("ckpt"), dir.file("offline.safetensors"));
  EXPECT_EQ(testing::readFileBytes(dir.file("online.safetensors")),
            testing::readFileBytes(dir.file("offline.safetensors")));
}

// A non-persistent tensor (a buffer no state_dict key holds) is in the
// EMA but not in what stands for the model's state: fullStateDict without
// names and both exports leave it out (a strict load of them finds no
// unexpected key); asked for by name it is there, and the checkpoint's
// manifest records it, so the offline export agrees byte for byte.
TEST(ShardedOnlineTest, NonPersistentTensorsAreKeptButNotExported) {
  testing::TempDir dir;
  const auto model = testing::unevenModel(at::kBFloat16, true);
  const std::set<std::string> transient = {"big", "one"};
  testing::PerTensorJob job(model, shard::LayoutKind::kFsdp2, 1);
  job.run(1, kSteps);
  std::mutex mutex;
  std::vector<std::pair<std::string, at::Tensor>> gathered, named;
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const auto averager = trainedRank(model, comm.rank(), tensors, {}, transient);
    EXPECT_EQ(averager->nonPersistent(), transient);
    saveCheckpoint(comm, dir.file("ckpt"), *averager);
    shard::GatherOptions small;
    small.bufferBytes = 40;
    averager->exportWeights(comm, dir.file("online.safetensors"), at::kFloat, small);
    auto full = averager->fullStateDict(comm, small);
    auto only = averager->fullStateDict(comm, small, std::vector<std::string>{"big"});
    std::lock_guard<std::mutex> lock(mutex);
    if (comm.rank() == 0) gathered = std::move(full), named = std::move(only);
  });
  std::vector<std::string> kept;
  for (const testing::ModelTensor& tensor : model) {
    if (!transient.count(tensor.name)) kept.push_back(tensor.name);
  }
  ASSERT_LT(kept.size(), model.size());
  const TensorFile online = readTensorFile(dir.file("online.safetensors"));
  ASSERT_EQ(online.tensors.size(), kept.size());
  ASSERT_EQ(gathered.size(), kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_EQ(online.tensors[i].first, kept[i]);
    EXPECT_EQ(gathered[i].first, kept[i]);
    EXPECT_TRUE(testing::sameTensor(gathered[i].second, job.reference.ema(kept[i]))) << kept[i];
  }
  ASSERT_EQ(named.size(), 1u);
  EXPECT_TRUE(testing::sameTensor(named[0].second, job.reference.ema("big")));
  EXPECT_EQ(inspectCheckpoint(dir.file("ckpt")).nonPersistent, transient);
  exportCheckpoint(dir.file("ckpt"), dir.file("offline.safetensors"));
  EXPECT_EQ(testing::readFileBytes(dir.file("online.safetensors")),
            testing::readFileBytes(dir.file("offline.safetensors")));
  // Loaded back, the non-persistent EMA is there (a resume restores it).
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    std::vector<at::Tensor> tensors;
    const auto fresh = trainedRank(model, comm.rank(), tensors, {}, transient);
    loadCheckpoint(dir.file("ckpt"), *fresh);
    auto only = fresh->fullStateDict(comm, {}, std::vector<std::string>{"big"});
    if (comm.rank() == 0) {
      EXPECT_TRUE(testing::sameTensor(only.at(0).second, job.reference.ema("big")));
    }
  });
}

// Tensor parallelism's Shard(2) pieces (torch.chunk along dim 2, 7 over 3
// ranks: 3 + 3 + 1 columns, each piece in its own shape, as a DTensor's
// to_local()), given with the spec of the tensor with dim 2 moved first
// and LocalShard::splitDim: fullStateDict and exportWeights (pieces of 40
// bytes) give the tensor in its own shape and order; a per-rank checkpoint
// is refused naming it. Values encode their index, so a misplaced element
// shows. Once only the Python front could gather these (DTensor
// collectives), and export_weights refused them.
TEST(ShardedOnlineTest, SplitDimPiecesGatherAndExportInTheTensorsOwnOrder) {
  testing::TempDir dir;
  const at::Tensor whole = at::arange(4 * 5 * 7, at::kFloat).reshape({4, 5, 7});
  std::mutex mutex;
  std::vector<std::pair<std::string, at::Tensor>> gathered;
  std::vector<std::string> saveErrors(kWorld);
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    const auto pieces = whole.chunk(kWorld, 2);
    at::Tensor local = comm.rank() < static_cast<int64_t>(pieces.size())
                           ? pieces[comm.rank()].contiguous()
                           : whole.narrow(2, 0, 0).contiguous();
    LocalShard shard{local, shard::fsdp2Spec("w", {7, 4, 5}, at::kFloat, kWorld)};
    shard.splitDim = 2;
    ShardedAverager averager(comm.rank(), kWorld, {shard}, testing::smallChunkOptions());
    shard::GatherOptions small;
    small.bufferBytes = 40;
    averager.exportWeights(comm, dir.file("w.safetensors"), at::kFloat, small);
    auto full = averager.fullStateDict(comm, small);
    try {
      saveCheckpoint(comm, dir.file("ckpt"), averager);
    } catch (const c10::Error& error) {
      std::lock_guard<std::mutex> lock(mutex);
      saveErrors[comm.rank()] = error.what_without_backtrace();
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (comm.rank() == 0) gathered = std::move(full);
  });
  ASSERT_EQ(gathered.size(), 1u);
  EXPECT_TRUE(testing::sameTensor(gathered[0].second, whole));
  EXPECT_EQ(gathered[0].second.sizes(), whole.sizes());
  const TensorFile exported = readTensorFile(dir.file("w.safetensors"));
  ASSERT_EQ(exported.tensors.size(), 1u);
  EXPECT_EQ(exported.tensors[0].second.sizes(), whole.sizes());
  EXPECT_TRUE(testing::sameTensor(exported.tensors[0].second, whole));
  for (const std::string& error : saveErrors) {
    EXPECT_NE(error.find("tensor 'w' is split along dim 2"), std::string::npos) << error;
  }
  EXPECT_FALSE(fs::exists(dir.file("ckpt") + "/manifest.json"));
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
