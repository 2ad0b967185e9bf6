// PostHocCallback with two ranks (threads over Gloo): every rank holds the
// same replicated module and trains it on the same data, as under DDP. The
// rank-0 full copy and the sharded layout must give the same deployable
// weights and validation swap (within fp32 rounding), each with its own
// file layout, and the offline merge of a sharded folder must agree with
// the callback's gathered file.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "lib/posthoc_fixture.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/posthoc_callback.h"
#include "shardema/shard/communicator.h"
#include "shardema/synthesis.h"
#include "support/thread_ranks.h"

namespace shardema::posthoc_test {
namespace {

constexpr int64_t kWorld = 2;
constexpr int64_t kSeed = 30;

// What one rank saw; filled on its thread, checked on the test's.
struct RankResult {
  int64_t calls = 0;
  bool holdsEma = false;
  std::string snapshotFolder;
  bool swapped = false;
  std::string swapError;    // what onValidationStart threw, if it did
  Values duringValidation;  // every module tensor while the EMA was in
  std::vector<std::string> notRestored;
  std::string deployable;  // onTrainEnd's return
  std::vector<Values> counted;
};

// 10 steps (snapshots at 4 and 8), a validation swap (newest snapshot: 8),
// then the end of training (final snapshot at 10, synthesis at 10).
std::vector<RankResult> runTwoRanks(PostHocLayout layout, const std::string& folder,
                                    const std::string& output,
                                    EmaStorage ema = EmaStorage::kPinnedHost) {
  std::vector<RankResult> results(kWorld);
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    PostHocCallbackOptions options = posthoc_test::smallOptions(folder, 4, output);
    options.layout = layout;
    options.storage = ema;
    PostHocRun run(kSeed, options, PostHocRanks{comm.rank(), kWorld, &comm});
    run.fit(2, 5);
    RankResult& result = results[comm.rank()];
    result.calls = run.callback().calls();
    result.holdsEma = run.callback().holdsEma();
    result.snapshotFolder = run.callback().snapshotFolder();
    const NamedTensors raw = cloneModuleTensors(*run.net);
    // A failed swap is recorded, not rethrown, so the end of training is
    // still checked.
    try {
      result.swapped = run.callback().onValidationStart();
    } catch (const c10::Error& error) {
      result.swapError = error.what_without_backtrace();
    }
    for (const auto& [name, tensor] : moduleTensors(*run.net)) {
      result.duringValidation[name] = tensor.detach().clone();
    }
    run.callback().onValidationEnd();
    const NamedTensors restored = moduleTensors(*run.net);
    for (size_t i = 0; i < raw.size(); ++i) {
      if (!restored[i].second.equal(raw[i].second)) result.notRestored.push_back(raw[i].first);
    }
    result.deployable = run.callback().onTrainEnd();
    result.counted = run.counted;
  });
  return results;
}

void expectCommonLifecycle(const std::vector<RankResult>& results, const std::string& output) {
  for (int64_t r = 0; r < kWorld; ++r) {
    EXPECT_EQ(results[r].calls, 10) << "rank " << r;
    EXPECT_TRUE(results[r].swapped) << "rank " << r << ": " << results[r].swapError;
    EXPECT_TRUE(results[r].notRestored.empty())
        << "rank " << r << ": " << results[r].notRestored.front() << " not restored";
  }
  EXPECT_EQ(results[0].deployable,
            output + "/" + PostHocCallback::deployableFileName("shardema_ema_final", 0.05, 10));
  EXPECT_EQ(results[1].deployable, "");
}

TEST(PostHocRanksTest, RankZeroFullCopyKeepsTopLevelSnapshotsOfRankZero) {
  TempDir folder;
  TempDir output;
  const auto results = runTwoRanks(PostHocLayout::kRankZero, folder.path(), output.path());
  expectCommonLifecycle(results, output.path());
  EXPECT_TRUE(results[0].holdsEma);
  EXPECT_FALSE(results[1].holdsEma);
  EXPECT_EQ(results[0].snapshotFolder, folder.path());
  // Full-copy files only: no rank_ folders, no shard metadata.
  EXPECT_EQ(posthoc_test::filesIn(folder.path()), posthoc_test::snapshotNames({4, 8, 10}));
  for (const auto& name : posthoc_test::filesIn(folder.path())) {
    EXPECT_FALSE(readSnapshotInfo(folder.file(name)).sharded()) << name;
  }
  // The snapshots hold rank 0's EMA of what the loop saw.
  const Values expected = posthoc_test::referenceEma(results[0].counted, 0.1, 8);
  const TensorFile snapshot = readTensorFile(folder.file("1.8.safetensors"));
  for (const auto& [name, want] : expected) {
    EXPECT_TRUE(posthoc_test::closeTo(snapshot.at(name), want, 1e-6, name));
  }
  posthoc_test::expectFileMatches(
      readTensorFile(results[0].deployable),
      posthoc_test::referenceSynthesis(folder.path(), {0.05, 0.1}, {4, 8, 10}, 0.05, 10), 1e-6,
      "deployable");
}

TEST(PostHocRanksTest, ShardedLayoutWritesOneFolderPerRank) {
  TempDir folder;
  TempDir output;
  const auto results = runTwoRanks(PostHocLayout::kSharded, folder.path(), output.path());
  expectCommonLifecycle(results, output.path());
  EXPECT_EQ(posthoc_test::filesIn(folder.path()),
            (std::set<std::string>{"rank_00000", "rank_00001"}));
  for (int64_t r = 0; r < kWorld; ++r) {
    const std::string rankFolder = folder.path() + "/" + (r == 0 ? "rank_00000" : "rank_00001");
    EXPECT_TRUE(results[r].holdsEma) << "rank " << r;
    EXPECT_EQ(results[r].snapshotFolder, rankFolder);
    EXPECT_EQ(posthoc_test::filesIn(rankFolder), posthoc_test::snapshotNames({4, 8, 10}));
    std::set<std::string> layouts;
    for (const auto& name : posthoc_test::filesIn(rankFolder)) {
      const SnapshotInfo info = readSnapshotInfo(rankFolder + "/" + name);
      EXPECT_EQ(info.rank, r) << name;
      EXPECT_EQ(info.worldSize, kWorld) << name;
      EXPECT_FALSE(info.layoutJson.empty()) << name;
      layouts.insert(info.layoutJson);
    }
    EXPECT_EQ(layouts.size(), 1u) << "rank " << r << ": one layout for every snapshot";
  }
  const SnapshotFolder scan = scanSnapshotFolder(folder.path());
  EXPECT_TRUE(scan.sharded);
  EXPECT_EQ(scan.worldSize, kWorld);
}

// The two-rank run of each post-hoc layout on the given EMA storage,
// each with its own snapshot and output folders.
struct BothLayouts {
  explicit BothLayouts(EmaStorage ema)
      : full(runTwoRanks(PostHocLayout::kRankZero, folderA.path(), outputA.path(), ema)),
        sharded(runTwoRanks(PostHocLayout::kSharded, folderB.path(), outputB.path(), ema)) {}
  TempDir folderA;
  TempDir outputA;
  TempDir folderB;
  TempDir outputB;
  std::vector<RankResult> full;
  std::vector<RankResult> sharded;
};

// Both post-hoc layouts on the given EMA storage, then the offline merge of the
// sharded folder.
void expectTheSameDeployableWeights(EmaStorage ema) {
  const BothLayouts runs(ema);
  const auto& full = runs.full;
  const auto& sharded = runs.sharded;
  ASSERT_FALSE(full[0].deployable.empty());
  ASSERT_FALSE(sharded[0].deployable.empty());
  const TensorFile fromFull = readTensorFile(full[0].deployable);
  const TensorFile fromShards = readTensorFile(sharded[0].deployable);
  EXPECT_EQ(fromShards.metadata.at("shardema.step"), "10");
  const Values fullValues(fromFull.tensors.begin(), fromFull.tensors.end());
  posthoc_test::expectFileMatches(fromShards, fullValues, 1e-6, "sharded vs full");
  // Offline: rank folders synthesized one by one and merged into full tensors.
  SnapshotSynthesisOptions offline;
  offline.sigmaRel = 0.05;
  const std::string offlineFile = runs.outputB.file("offline.safetensors");
  synthesizeSnapshotFolder(runs.folderB.path(), offlineFile, offline);
  const TensorFile merged = readTensorFile(offlineFile);
  posthoc_test::expectFileMatches(merged,
                                  Values(fromShards.tensors.begin(), fromShards.tensors.end()),
                                  1e-6, "offline merge vs callback");
}

TEST(PostHocRanksTest, BothLayoutsAndTheOfflineMergeGiveTheSameWeights) {
  expectTheSameDeployableWeights(EmaStorage::kPinnedHost);
}

TEST(PostHocRanksTest, BothLayoutsGiveTheSameWeightsOnTheDeviceStorage) {
  expectTheSameDeployableWeights(EmaStorage::kDevice);
}

// Both post-hoc layouts on the given EMA storage: the values each rank's module
// held during the validation swap.
void expectTheSameSwapInEveryRank(EmaStorage ema) {
  const BothLayouts runs(ema);
  const auto& full = runs.full;
  const auto& sharded = runs.sharded;
  for (int64_t r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(full[r].swapped) << "full rank " << r << ": " << full[r].swapError;
    ASSERT_TRUE(sharded[r].swapped) << "sharded rank " << r << ": " << sharded[r].swapError;
    EXPECT_TRUE(full[r].notRestored.empty()) << "full rank " << r;
    EXPECT_TRUE(sharded[r].notRestored.empty()) << "sharded rank " << r;
  }
  // Reference: the synthesis at the newest snapshot (8) of the full folder,
  // taken before onTrainEnd added the one at 10.
  SnapshotSynthesisOptions at8;
  at8.sigmaRel = 0.05;
  at8.step = 8;
  const SynthesizedTensors synthesized =
      synthesizeSnapshots(scanSnapshotFolder(runs.folderA.path()).snapshots, at8);
  for (const auto& [name, want] : synthesized.tensors) {
    if (!at::isFloatingType(want.scalar_type())) continue;
    // Rank-0 full copy: rank 0 synthesizes and broadcasts, so both ranks
    // hold the very same values.
    const at::Tensor& rank0 = full[0].duringValidation.at(name);
    EXPECT_TRUE(full[1].duringValidation.at(name).equal(rank0)) << name;
    EXPECT_TRUE(posthoc_test::closeTo(rank0, want, 1e-6, "full " + name));
    // Sharded over a replicated module: the rows are gathered, so every
    // rank swaps in the whole EMA, not just the rows it keeps.
    for (int64_t r = 0; r < kWorld; ++r) {
      const at::Tensor& mine = sharded[r].duringValidation.at(name);
      EXPECT_TRUE(posthoc_test::closeTo(mine, want, 1e-6,
                                        "sharded rank " + std::to_string(r) + " " + name));
    }
    EXPECT_TRUE(sharded[1].duringValidation.at(name).equal(sharded[0].duringValidation.at(name)))
        << name;
  }
  // Integer buffers stay live on every rank: 10 batches counted.
  for (const auto* results : {&full, &sharded}) {
    for (int64_t r = 0; r < kWorld; ++r) {
      EXPECT_EQ((*results)[r].duringValidation.at("bn.num_batches_tracked").item<int64_t>(), 10);
    }
  }
}

TEST(PostHocRanksTest, ValidationSwapPutsTheSameEmaIntoEveryRank) {
  expectTheSameSwapInEveryRank(EmaStorage::kPinnedHost);
}

TEST(PostHocRanksTest, ValidationSwapPutsTheSameEmaIntoEveryRankOnTheDeviceStorage) {
  expectTheSameSwapInEveryRank(EmaStorage::kDevice);
}

}  // namespace
}  // namespace shardema::posthoc_test
