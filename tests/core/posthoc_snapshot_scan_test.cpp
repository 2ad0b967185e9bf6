// scanSnapshotFolder: the folders of both post-hoc layouts and every way
// a folder can be inconsistent (DESIGN.md section 5).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/posthoc_snapshot_fixture.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "support/temp_dir.h"
#include "support/value_error.h"

namespace shardema {
namespace {

using namespace snapshot_test;  // NOLINT: the fixture helpers
namespace fs = std::filesystem;

TEST(PosthocSnapshotTest, ScansAFullFolderInOrder) {
  testing::TempDir dir;
  writeIn(dir.path(), fullInfo(1, 20, 0.10));
  writeIn(dir.path(), fullInfo(0, 100, 0.05));
  writeIn(dir.path(), fullInfo(0, 20, 0.05));
  writeIn(dir.path(), fullInfo(1, 3, 0.10));
  // Leftovers and unrelated files are ignored.
  std::ofstream(dir.file("0.200.safetensors.tmp")) << "partial";
  std::ofstream(dir.file("notes.txt")) << "hello";
  fs::create_directories(dir.file("logs"));

  const SnapshotFolder folder = scanSnapshotFolder(dir.path());
  EXPECT_FALSE(folder.sharded);
  EXPECT_EQ(folder.worldSize, 0);
  EXPECT_TRUE(folder.perRank.empty());
  ASSERT_EQ(folder.snapshots.size(), 4u);
  const std::pair<int64_t, int64_t> order[] = {{3, 1}, {20, 0}, {20, 1}, {100, 0}};
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(folder.snapshots[k].info.step, order[k].first) << k;
    EXPECT_EQ(folder.snapshots[k].info.profileIndex, order[k].second) << k;
    EXPECT_EQ(fs::path(folder.snapshots[k].path).filename().string(),
              snapshotFileName(order[k].second, order[k].first));
  }
  EXPECT_EQ(folder.snapshots[1].info.gamma, sigmaRelToGamma(0.05));
}

TEST(PosthocSnapshotTest, ScansAShardedFolder) {
  testing::TempDir dir;
  for (int64_t rank = 0; rank < 2; ++rank) {
    const std::string rankDir = dir.file(rankFolderName(rank));
    writeIn(rankDir, shardInfo(1, 10, 0.10, rank, 2));
    writeIn(rankDir, shardInfo(0, 10, 0.05, rank, 2));
    writeIn(rankDir, shardInfo(0, 5, 0.05, rank, 2));
    std::ofstream(rankDir + "/0.15.safetensors.tmp") << "partial";
  }
  const SnapshotFolder folder = scanSnapshotFolder(dir.path());
  EXPECT_TRUE(folder.sharded);
  EXPECT_EQ(folder.worldSize, 2);
  EXPECT_TRUE(folder.snapshots.empty());
  ASSERT_EQ(folder.perRank.size(), 2u);
  for (int64_t rank = 0; rank < 2; ++rank) {
    const auto& entries = folder.perRank[rank];
    ASSERT_EQ(entries.size(), 3u);
    EXPECT_EQ(entries[0].info.step, 5);
    EXPECT_EQ(entries[1].info.step, 10);
    EXPECT_EQ(entries[1].info.profileIndex, 0);
    EXPECT_EQ(entries[2].info.profileIndex, 1);
    for (const SnapshotEntry& entry : entries) {
      EXPECT_EQ(entry.info.rank, rank);
      EXPECT_EQ(fs::path(entry.path).parent_path().filename().string(), rankFolderName(rank));
    }
  }
}

TEST(PosthocSnapshotTest, ScanRefusesMissingOrEmptyFolders) {
  testing::TempDir dir;
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.file("absent")), dir.file("absent"));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "no posthoc snapshots");
  std::ofstream(dir.file("0.1.safetensors.tmp")) << "partial";
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "no posthoc snapshots");
  fs::create_directories(dir.file("rank_00000"));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "rank_00000");
}

TEST(PosthocSnapshotTest, ScanRefusesForeignSafetensorsNames) {
  testing::TempDir dir;
  writeIn(dir.path(), fullInfo(0, 10, 0.05));
  TensorFile other;
  other.tensors.emplace_back("w", at::zeros({1}));
  writeTensorFile(dir.file("model.safetensors"), other);
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), dir.file("model.safetensors"));
}

TEST(PosthocSnapshotTest, ScanRefusesMixedLayouts) {
  testing::TempDir dir;
  writeIn(dir.path(), fullInfo(0, 10, 0.05));
  writeIn(dir.file(rankFolderName(0)), shardInfo(0, 10, 0.05, 0, 1));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "mixed layouts");
}

TEST(PosthocSnapshotTest, ScanRefusesAShardedFileAtTheTop) {
  testing::TempDir dir;
  writeIn(dir.path(), shardInfo(0, 10, 0.05, 0, 1));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), dir.file("0.10.safetensors"));
}

TEST(PosthocSnapshotTest, ScanRefusesDuplicateGammaAtOneStep) {
  testing::TempDir dir;
  writeIn(dir.path(), fullInfo(0, 10, 0.05));
  writeIn(dir.path(), fullInfo(1, 10, 0.05));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "duplicate (step, gamma)");

  // The same gamma at different steps is the normal case.
  testing::TempDir ok;
  writeIn(ok.path(), fullInfo(0, 10, 0.05));
  writeIn(ok.path(), fullInfo(0, 20, 0.05));
  EXPECT_EQ(scanSnapshotFolder(ok.path()).snapshots.size(), 2u);

  testing::TempDir sharded;
  writeIn(sharded.file(rankFolderName(0)), shardInfo(0, 10, 0.05, 0, 1));
  writeIn(sharded.file(rankFolderName(0)), shardInfo(1, 10, 0.05, 0, 1));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(sharded.path()), "duplicate (step, gamma)");
}

TEST(PosthocSnapshotTest, ScanRefusesAMissingRank) {
  testing::TempDir dir;
  writeIn(dir.file(rankFolderName(0)), shardInfo(0, 10, 0.05, 0, 3));
  writeIn(dir.file(rankFolderName(2)), shardInfo(0, 10, 0.05, 2, 3));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "missing rank_00001");
}

TEST(PosthocSnapshotTest, ScanRefusesAnExtraRank) {
  testing::TempDir dir;
  writeIn(dir.file(rankFolderName(0)), shardInfo(0, 10, 0.05, 0, 1));
  // rank 1 of world size 1 cannot be written at all...
  EXPECT_VALUE_ERROR(writeIn(dir.file(rankFolderName(1)), shardInfo(0, 10, 0.05, 1, 1)),
                     "worldSize");
  EXPECT_FALSE(fs::exists(dir.file("rank_00001/0.10.safetensors")));
  // ...so an extra rank folder shows up as an empty one or a world-size clash.
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "rank_00001");
  writeIn(dir.file(rankFolderName(1)), shardInfo(0, 10, 0.05, 1, 2));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "world size");
}

TEST(PosthocSnapshotTest, ScanRefusesAFileInTheWrongRankFolder) {
  testing::TempDir dir;
  writeIn(dir.file(rankFolderName(0)), shardInfo(0, 10, 0.05, 0, 2));
  writeIn(dir.file(rankFolderName(1)), shardInfo(0, 10, 0.05, 0, 2));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "metadata says rank 0");
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), dir.file("rank_00001/0.10.safetensors"));
}

TEST(PosthocSnapshotTest, ScanRefusesMixedWorldSizes) {
  testing::TempDir dir;
  for (int64_t rank = 0; rank < 2; ++rank) {
    writeIn(dir.file(rankFolderName(rank)), shardInfo(0, 10, 0.05, rank, 2));
  }
  writeIn(dir.file(rankFolderName(1)), shardInfo(0, 20, 0.05, 1, 3));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "world size 3");
}

TEST(PosthocSnapshotTest, ScanRefusesMixedLayoutsWithinARank) {
  testing::TempDir dir;
  for (int64_t rank = 0; rank < 2; ++rank) {
    writeIn(dir.file(rankFolderName(rank)), shardInfo(0, 10, 0.05, rank, 2, "{\"v\":1}"));
  }
  writeIn(dir.file(rankFolderName(1)), shardInfo(0, 20, 0.05, 1, 2, "{\"v\":2}"));
  writeIn(dir.file(rankFolderName(0)), shardInfo(0, 20, 0.05, 0, 2, "{\"v\":1}"));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "mixed layouts");
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "rank_00001");
}

TEST(PosthocSnapshotTest, ScanRefusesRanksWithDifferentSnapshots) {
  testing::TempDir dir;
  for (int64_t rank = 0; rank < 2; ++rank) {
    writeIn(dir.file(rankFolderName(rank)), shardInfo(0, 10, 0.05, rank, 2));
  }
  writeIn(dir.file(rankFolderName(0)), shardInfo(0, 20, 0.05, 0, 2));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(dir.path()), "different set");

  testing::TempDir swapped;
  writeIn(swapped.file(rankFolderName(0)), shardInfo(0, 10, 0.05, 0, 2));
  writeIn(swapped.file(rankFolderName(1)), shardInfo(1, 10, 0.05, 1, 2));
  EXPECT_VALUE_ERROR(scanSnapshotFolder(swapped.path()), "rank_00001");
}

// An independent reader: numpy and the json module, no shardema code.

}  // namespace
}  // namespace shardema
