// Per-rank tensors (shard::LayoutKind::kPerRank): tensors the ranks do not
// keep equal, such as BatchNorm statistics under DDP and FSDP2. Every rank
// keeps the EMA of its own whole copy; rank 0's stands for the job in a
// gather, an export, a checkpoint, a reshard and a load at any world size.
// Each rank's buffers differ here, so a value of the wrong rank names itself;
// every check is bit for bit against a single-process Averager of that
// rank's own tensors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <mutex>

#include "lib/sharded_fixture.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/detail/rank_manifest.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"
#include "support/value_error.h"

namespace shardema {
namespace {

using testing::ModelTensor;
using testing::sameTensor;

constexpr int64_t kWorld = 3;
constexpr int64_t kSteps = 4;

// Parameters, equal on every rank (each rank averages its rows), then the
// buffers each rank keeps whole: averaged (ema_pytorch), copied (versatil),
// a 0-dim integer counter, an empty one.
const std::vector<ModelTensor> kParameters = {{"weight", {5, 3}}, {"bias", {4}}};
const std::vector<ModelTensor> kBuffers = {{"running_mean", {6}, at::kFloat, TrackRole::kAverage},
                                           {"running_var", {6}, at::kFloat, TrackRole::kCopy},
                                           {"empty_stat", {0}, at::kFloat, TrackRole::kCopy},
                                           {"num_batches", {}, at::kLong, TrackRole::kCopy}};

std::vector<ModelTensor> allTensors() {
  std::vector<ModelTensor> all = kParameters;
  all.insert(all.end(), kBuffers.begin(), kBuffers.end());
  return all;
}

bool isBuffer(const std::string& name) {
  for (const ModelTensor& b : kBuffers) {
    if (b.name == name) return true;
  }
  return false;
}

// Rank `rank`'s tensors at `step`: the parameters are every rank's, the
// buffers its own (shifted by rank).
void setRankValues(int64_t rank, int64_t step, std::vector<at::Tensor>& tensors) {
  const std::vector<ModelTensor> all = allTensors();
  testing::setModel(all, tensors, step);
  for (size_t i = kParameters.size(); i < all.size(); ++i) tensors[i].add_(10 * (rank + 1));
}

// One rank's own memory: its tensors, a ShardedAverager over them
// (parameters replicated, buffers per-rank) and a single-process Averager of
// the same tensors, the reference.
struct PerRankModel {
  PerRankModel(int64_t rank, int64_t worldSize)
      : tensors(testing::makeModel(allTensors(), 0)), reference(tracked(), referenceOptions()) {
    setRankValues(rank, 0, tensors);
    const std::vector<TrackedTensor> all = tracked();
    const std::vector<TrackedTensor> parameters(all.begin(), all.begin() + kParameters.size());
    const std::vector<TrackedTensor> buffers(all.begin() + kParameters.size(), all.end());
    std::vector<LocalShard> shards =
        shardsFromFullTensors(parameters, shard::LayoutKind::kReplicated, rank, worldSize);
    for (LocalShard& s :
         shardsFromFullTensors(buffers, shard::LayoutKind::kPerRank, rank, worldSize)) {
      shards.push_back(std::move(s));
    }
    averager = std::make_unique<ShardedAverager>(rank, worldSize, std::move(shards),
                                                 testing::smallChunkOptions());
  }
  std::vector<TrackedTensor> tracked() const {
    return testing::trackedModel(allTensors(), tensors);
  }
  static AveragerOptions referenceOptions() { return testing::smallChunkOptions(); }
  void run(int64_t rank, int64_t first, int64_t last) {
    for (int64_t step = first; step <= last; ++step) {
      setRankValues(rank, step, tensors);
      averager->update(step);
      reference.update(step);
      averager->fence();
      reference.fence();
    }
    averager->wait();
    reference.wait();
  }

  std::vector<at::Tensor> tensors;
  Averager reference;
  std::unique_ptr<ShardedAverager> averager;
};

std::vector<std::unique_ptr<PerRankModel>> trainedJob(int64_t worldSize) {
  std::vector<std::unique_ptr<PerRankModel>> ranks;
  for (int64_t r = 0; r < worldSize; ++r) {
    ranks.push_back(std::make_unique<PerRankModel>(r, worldSize));
    ranks.back()->run(r, 1, kSteps);
  }
  return ranks;
}

std::vector<const ShardedAverager*> averagersOf(
    const std::vector<std::unique_ptr<PerRankModel>>& ranks) {
  std::vector<const ShardedAverager*> out;
  for (const auto& rank : ranks) out.push_back(rank->averager.get());
  return out;
}

// What `averager` (rank r of its job) holds after a load of rank 0's EMA:
// of each buffer, the whole of `rankZero`'s; of each parameter, its rows.
void expectHoldsRankZeros(const ShardedAverager& averager, const Averager& rankZero,
                          const std::string& what) {
  const std::vector<at::Tensor> pieces = averager.localEma();
  const shard::ShardLayout& layout = averager.layout();
  ASSERT_EQ(pieces.size(), layout.specs.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const shard::ShardSpec& spec = layout.specs[i];
    const shard::ElementRange held = spec.heldRange(averager.rank());
    EXPECT_EQ(spec.kind,
              isBuffer(spec.name) ? shard::LayoutKind::kPerRank : shard::LayoutKind::kReplicated);
    const at::Tensor want =
        rankZero.ema(spec.name).reshape({-1}).narrow(0, held.begin, held.size());
    EXPECT_TRUE(sameTensor(pieces[i], want))
        << what << ": rank " << averager.rank() << " '" << spec.name << "'";
  }
}

TEST(ShardedPerRankTest, EachRankKeepsTheEmaOfItsOwnCopy) {
  const auto ranks = trainedJob(kWorld);
  for (int64_t r = 0; r < kWorld; ++r) {
    const ShardedAverager& averager = *ranks[static_cast<size_t>(r)]->averager;
    const std::vector<at::Tensor> pieces = averager.localEma();
    for (size_t i = 0; i < pieces.size(); ++i) {
      const shard::ShardSpec& spec = averager.layout().specs[i];
      const shard::ElementRange held = spec.heldRange(r);
      const at::Tensor own = ranks[static_cast<size_t>(r)]->reference.ema(spec.name);
      EXPECT_EQ(held.size(), isBuffer(spec.name) ? spec.numel() : spec.rangeOf(r).size());
      EXPECT_TRUE(sameTensor(pieces[i], own.reshape({-1}).narrow(0, held.begin, held.size())))
          << "rank " << r << " '" << spec.name << "'";
    }
    // The ranks' buffers differ: a check against the wrong rank would fail.
    if (r > 0) {
      EXPECT_FALSE(sameTensor(ranks[static_cast<size_t>(r)]->reference.ema("running_mean"),
                              ranks[0]->reference.ema("running_mean")));
    }
  }
  // A local of the rows' size is not a per-rank tensor's.
  std::vector<at::Tensor> tensors = testing::makeModel(kBuffers, 0);
  std::vector<LocalShard> shards = shardsFromFullTensors(testing::trackedModel(kBuffers, tensors),
                                                         shard::LayoutKind::kPerRank, 1, 2);
  shards[0].local = shards[0].local.narrow(0, 3, 3);
  EXPECT_VALUE_ERROR(ShardedAverager(1, 2, shards),
                     "'running_mean' has a local shard of 3 elements");
}

// Over real Gloo (ranks as threads): fullStateDict to every rank and the
// streaming export take rank 0's buffers; the online save then loads rank
// 0's into every rank.
TEST(ShardedPerRankTest, GatherExportSaveAndLoadTakeRankZeros) {
  testing::TempDir dir;
  const auto job = trainedJob(kWorld);
  const Averager& rankZero = job[0]->reference;
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    PerRankModel mine(comm.rank(), kWorld);
    mine.run(comm.rank(), 1, kSteps);
    shard::GatherOptions everyRank;
    everyRank.root = -1;
    everyRank.bufferBytes = 40;
    for (const auto& [name, tensor] : mine.averager->fullStateDict(comm, everyRank)) {
      EXPECT_TRUE(sameTensor(tensor, rankZero.ema(name))) << "rank " << comm.rank() << " " << name;
    }
    mine.averager->exportWeights(comm, dir.file("export.safetensors"));
    saveCheckpoint(comm, dir.file("ckpt"), *mine.averager);
    PerRankModel fresh(comm.rank(), kWorld);
    loadCheckpoint(dir.file("ckpt"), *fresh.averager);
    expectHoldsRankZeros(*fresh.averager, rankZero, "online save, load");
  });
  const TensorFile exported = readTensorFile(dir.file("export.safetensors"));
  ASSERT_EQ(exported.tensors.size(), allTensors().size());
  for (const auto& [name, tensor] : exported.tensors) {
    EXPECT_TRUE(sameTensor(tensor, rankZero.ema(name))) << "export '" << name << "'";
  }
}

TEST(ShardedPerRankTest, RankFilesHoldRankZerosAloneAndEveryRankLoadsThem) {
  testing::TempDir dir;
  const auto job = trainedJob(kWorld);
  saveCheckpoint(dir.path(), averagersOf(job));
  const RankManifest manifest = inspectCheckpoint(dir.path());
  for (int64_t r = 0; r < kWorld; ++r) {
    const TensorFileReader reader(dir.file(manifest.files[static_cast<size_t>(r)].name));
    for (const ModelTensor& b : kBuffers) {
      const int64_t numel = at::empty(b.shape).numel();
      EXPECT_EQ(reader.entry(b.name).numel(), r == 0 ? numel : 0) << "rank " << r << " " << b.name;
    }
  }
  for (int64_t r = 0; r < kWorld; ++r) {
    PerRankModel fresh(r, kWorld);
    loadCheckpoint(dir.path(), *fresh.averager);
    expectHoldsRankZeros(*fresh.averager, job[0]->reference, "load");
    EXPECT_EQ(fresh.averager->step(), kSteps);
  }
}

// Another world size: reshard (what `shardema export --world-size` runs),
// then load; and the offline export. Every rank of every size gets rank 0's.
TEST(ShardedPerRankTest, ReshardAndExportCarryRankZerosToAnyWorldSize) {
  testing::TempDir dir;
  const auto job = trainedJob(kWorld);
  const Averager& rankZero = job[0]->reference;
  saveCheckpoint(dir.file("ckpt"), averagersOf(job));
  for (int64_t world : {int64_t{1}, int64_t{2}, int64_t{4}}) {
    const std::string out = dir.file("w" + std::to_string(world));
    ExportOptions small;
    small.bufferBytes = 8;
    reshardCheckpoint(dir.file("ckpt"), out, world, small);
    EXPECT_EQ(inspectCheckpoint(out).layout.at("running_mean"),
              shard::perRankSpec("running_mean", {6}, at::kFloat, world));
    for (int64_t r = 0; r < world; ++r) {
      PerRankModel fresh(r, world);
      loadCheckpoint(out, *fresh.averager);
      expectHoldsRankZeros(*fresh.averager, rankZero, "W=" + std::to_string(world));
    }
  }
  exportCheckpoint(dir.file("ckpt"), dir.file("export.safetensors"));
  const TensorFile exported = readTensorFile(dir.file("export.safetensors"));
  for (const auto& [name, tensor] : exported.tensors) {
    EXPECT_TRUE(sameTensor(tensor, rankZero.ema(name))) << "export '" << name << "'";
  }
}

// A load on rank 1 reads its per-rank tensors from rank 0's file, each
// against its own checksum: a flipped byte there fails the load, naming the
// file and the tensor, and the EMA is left as it was.
TEST(ShardedPerRankTest, RankZerosTensorsAreCheckedWhereOtherRanksReadThem) {
  testing::TempDir dir;
  const auto job = trainedJob(2);
  saveCheckpoint(dir.path(), averagersOf(job));
  const RankManifest manifest = readManifest(dir.path());
  const std::string rankZeroFile = dir.file(manifest.files[0].name);
  {  // The last tensor's last byte: num_batches, rank 0's copy.
    std::fstream file(rankZeroFile, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    const char byte = static_cast<char>(file.get() ^ 0x40);
    file.seekp(-1, std::ios::end);
    file.put(byte);
  }
  PerRankModel fresh(1, 2);
  std::vector<at::Tensor> before = fresh.averager->localEma();
  for (at::Tensor& t : before) t = t.clone();  // localEma() may be views of the EMA
  EXPECT_VALUE_ERROR(loadCheckpoint(dir.path(), *fresh.averager), manifest.files[0].name);
  EXPECT_VALUE_ERROR(loadCheckpoint(dir.path(), *fresh.averager), "'num_batches'");
  const std::vector<at::Tensor> after = fresh.averager->localEma();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(sameTensor(after[i], before[i]));
}

// A checkpoint whose buffers were split in rows (replicated, as saved
// before per-rank tensors existed) holds rank 1's rows of rank 1's copy: it
// cannot give every rank rank 0's, and a load says which tensor differs.
TEST(ShardedPerRankTest, RowsOfBuffersAreNotLoadedAsPerRank) {
  testing::TempDir dir;
  testing::PerTensorJob rows(allTensors(), shard::LayoutKind::kReplicated, 2);
  rows.run(1, 2);
  saveCheckpoint(dir.path(), rows.averagers());
  PerRankModel fresh(1, 2);
  EXPECT_VALUE_ERROR(
      loadCheckpoint(dir.path(), *fresh.averager),
      "'running_mean' is laid out as replicated in the checkpoint but per_rank here");
}

}  // namespace
}  // namespace shardema
