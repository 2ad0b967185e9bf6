// Bad checkpoints: each is one error naming the file or tensor, and a failed
// export never replaces an existing output file.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "lib/sharded_fixture.h"
#include "shardema/core/checksum.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/detail/rank_manifest.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/value_error.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

struct SavedJob {
  SavedJob() : job(testing::unevenModel(at::kFloat, true), shard::LayoutKind::kFsdp2, 4) {
    job.run(1, 4);
    saveCheckpoint(dir.file("ckpt"), job.averagers());
  }
  std::string ckpt() const { return dir.file("ckpt"); }
  // Saves name their files rank_XXXXX.step_S.ID.safetensors: ask the manifest.
  std::string rankFile(int r) const { return ckpt() + "/" + readManifest(ckpt()).files[r].name; }

  // Rewrites the manifest so its record of rank r matches the file again
  // (forged files then pass the checksum and reach the content checks).
  void rerecord(int r) const {
    RankManifest manifest = readManifest(ckpt());
    manifest.files[r].size = fs::file_size(rankFile(r));
    manifest.files[r].checksum = fileChecksum(rankFile(r));
    writeManifest(ckpt(), manifest);
  }

  testing::TempDir dir;
  testing::PerTensorJob job;
};

// Every loader and tool refuses the folder with a message naming `what`.
void expectAllRefuse(const SavedJob& saved, const std::string& what) {
  EXPECT_VALUE_ERROR(inspectCheckpoint(saved.ckpt()), what);
  EXPECT_VALUE_ERROR(exportCheckpoint(saved.ckpt(), saved.dir.file("out")), what);
  EXPECT_VALUE_ERROR(reshardCheckpoint(saved.ckpt(), saved.dir.file("w2"), 2), what);
}

TEST(ShardedBadInputTest, MissingManifestMeansNoCheckpoint) {
  SavedJob saved;
  fs::remove(saved.ckpt() + "/manifest.json");
  expectAllRefuse(saved, "no valid checkpoint at " + saved.ckpt() + ": manifest.json missing");
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *saved.job.ranks[0].averager),
                     "manifest.json missing");
  testing::writeFileBytes(saved.ckpt() + "/manifest.json", "{\"format\": 1, \"kind\"");
  expectAllRefuse(saved, "manifest.json");
}

TEST(ShardedBadInputTest, MissingTruncatedOrCorruptedRankFilesNameTheFile) {
  SavedJob saved;
  const std::string path = saved.rankFile(2);
  const std::string bytes = testing::readFileBytes(path);
  fs::remove(path);
  expectAllRefuse(saved, "rank_00002.step_4.");
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *saved.job.ranks[2].averager), "missing");
  testing::writeFileBytes(path, bytes.substr(0, bytes.size() - 5));
  expectAllRefuse(saved, "rank_00002.step_4.");
  std::string flipped = bytes;
  flipped[bytes.size() - 3] ^= 0x40;  // same size, one bit of EMA data
  testing::writeFileBytes(path, flipped);
  expectAllRefuse(saved, "safetensors: XXH64");
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *saved.job.ranks[2].averager), "corrupted");
  // Rank 0 does not read rank 2's file, so its load still works.
  EXPECT_NO_THROW(loadCheckpoint(saved.ckpt(), *saved.job.ranks[0].averager));
}

// A checkpoint of another model names the first tensor that differs, not
// two fingerprints, and gives no resharding advice that could not help.
TEST(ShardedBadInputTest, AnotherModelNamesTheTensorThatDiffers) {
  SavedJob saved;
  std::vector<testing::RankModel> bf16 =
      testing::makeRanks(testing::unevenModel(at::kBFloat16, true), shard::LayoutKind::kFsdp2, 4);
  try {
    loadCheckpoint(saved.ckpt(), *bf16[0].averager);
    FAIL() << "a checkpoint of another model must be refused";
  } catch (const c10::ValueError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("is not of this model: tensor '"), std::string::npos) << message;
    EXPECT_NE(message.find("in the checkpoint but BFloat16 here"), std::string::npos) << message;
    EXPECT_EQ(message.find("reshard"), std::string::npos) << message;
  }
  EXPECT_EQ(bf16[0].averager->step(), 0);
}

TEST(ShardedBadInputTest, AnotherWorldSizeNamesBothLayoutsAndPointsToResharding) {
  SavedJob saved;
  std::vector<testing::RankModel> two =
      testing::makeRanks(saved.job.model, shard::LayoutKind::kFsdp2, 2);
  const std::string saved4 = saved.job.ranks[0].averager->layout().describe();
  const std::string here2 = two[0].averager->layout().describe();
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *two[0].averager), saved4);
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *two[0].averager), here2);
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *two[1].averager), "--world-size 2");
  // Same world size, a layout that gives the ranks other elements: also
  // refused, naming the tensor (resharding would not change the kind, so no
  // such advice). Replicated splits as FSDP2 does: that one loads
  // (ShardedCheckpointTest.AnyLayoutLoadsWhereEveryRankHoldsTheSameElements).
  std::vector<testing::RankModel> rankZero =
      testing::makeRanks(saved.job.model, shard::LayoutKind::kRankZero, 4);
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *rankZero[1].averager),
                     "is laid out as fsdp2 in the checkpoint but rank0 here");
  // A failed load changed nothing.
  EXPECT_EQ(two[0].averager->step(), 0);
}

// A rank file whose metadata claims another rank, world size or layout
// than the manifest gives it was once accepted by inspect and export (only
// the load checked shardema.rank). Every tool now names the file and key.
TEST(ShardedBadInputTest, RankMetadataThatDisagreesWithTheManifestIsRefusedNamingFileAndKey) {
  for (const auto& [key, forged] : std::vector<std::pair<std::string, std::string>>{
           {"shardema.rank", "2"},
           {"shardema.world_size", "5"},
           {"shardema.layout_fingerprint", "0123456789abcdef"}}) {
    SCOPED_TRACE(key);
    SavedJob saved;
    TensorFile file = readTensorFile(saved.rankFile(1));
    ASSERT_NE(file.metadata.at(key), forged);
    file.metadata[key] = forged;
    writeTensorFile(saved.rankFile(1), file);
    saved.rerecord(1);
    const std::string named = saved.rankFile(1) + ": " + key + " is '" + forged + "'";
    expectAllRefuse(saved, named);
    EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *saved.job.ranks[1].averager), named);
    EXPECT_NO_THROW(loadCheckpoint(saved.ckpt(), *saved.job.ranks[0].averager));
  }
}

// A failed reshard removes the rank files it wrote and the folder it
// (if it created it); before, they stayed behind as orphans.
TEST(ShardedBadInputTest, AFailedReshardLeavesNoFilesBehind) {
  SavedJob saved;
  const std::string out = saved.dir.file("w2");
  // A folder where the manifest goes: every rank file is written, then the
  // manifest's rename is refused.
  fs::create_directories(out + "/manifest.json");
  EXPECT_THROW(reshardCheckpoint(saved.ckpt(), out, 2), c10::ValueError);
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(out)) left.push_back(entry.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{"manifest.json"});
}

TEST(ShardedBadInputTest, UnknownOrDuplicateTensorNamesNameTheTensor) {
  SavedJob saved;
  TensorFile file = readTensorFile(saved.rankFile(1));
  file.tensors.emplace_back("stray.weight", at::zeros({2}));
  writeTensorFile(saved.rankFile(1), file);
  saved.rerecord(1);
  EXPECT_VALUE_ERROR(exportCheckpoint(saved.ckpt(), saved.dir.file("out")), "'stray.weight'");
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *saved.job.ranks[1].averager), "'stray.weight'");

  // Rename "prime" to "empty" in the header bytes (same length): a
  // duplicate name, which the safetensors parser rejects naming the file.
  file.tensors.pop_back();
  writeTensorFile(saved.rankFile(1), file);
  std::string bytes = testing::readFileBytes(saved.rankFile(1));
  const size_t at = bytes.find("\"prime\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 7, "\"empty\"");
  testing::writeFileBytes(saved.rankFile(1), bytes);
  saved.rerecord(1);
  EXPECT_VALUE_ERROR(exportCheckpoint(saved.ckpt(), saved.dir.file("out")), "rank_00001");
  // A layout with a duplicate name cannot be attached either.
  const shard::ShardSpec spec = shard::fsdp2Spec("dup", {4}, at::kFloat, 1);
  EXPECT_VALUE_ERROR(ShardedAverager(0, 1, {{at::zeros({4}), spec}, {at::zeros({4}), spec}}),
                     "'dup'");
}

TEST(ShardedBadInputTest, FailedExportLeavesTheOldOutputByteIdentical) {
  SavedJob saved;
  const std::string out = saved.dir.file("deployable.safetensors");
  exportCheckpoint(saved.ckpt(), out);
  const std::string before = testing::readFileBytes(out);
  ASSERT_FALSE(before.empty());
  std::string bytes = testing::readFileBytes(saved.rankFile(3));
  bytes[bytes.size() - 1] ^= 1;
  testing::writeFileBytes(saved.rankFile(3), bytes);
  ExportOptions bf16;
  bf16.outputDtype = at::kBFloat16;
  EXPECT_VALUE_ERROR(exportCheckpoint(saved.ckpt(), out, bf16), "rank_00003");
  EXPECT_EQ(testing::readFileBytes(out), before);
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  // A failed reshard leaves no manifest, so no checkpoint, in its folder.
  EXPECT_THROW(reshardCheckpoint(saved.ckpt(), saved.dir.file("w2"), 2), c10::ValueError);
  EXPECT_FALSE(fs::exists(saved.dir.file("w2/manifest.json")));
  EXPECT_VALUE_ERROR(reshardCheckpoint(saved.ckpt(), saved.ckpt(), 2), "elsewhere");
}

// The reproduction: a data byte of rank 1's "w" flipped (7.0f
// turns into 7.0001216f) and the manifest re-signed with the file's new size
// and XXH64. inspectCheckpoint and export once passed it, and export wrote
// the wrong value into a deployable file under a fresh checksum; only the
// load checked each tensor's own checksum. Now every tool does, before it
// writes anything.
TEST(ShardedBadInputTest, AFlippedDataByteUnderAReSignedManifestIsRefusedNamingTheTensor) {
  testing::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const shard::ShardSpec spec = shard::fsdp2Spec("w", {2, 2}, at::kFloat, 2);
  std::vector<std::unique_ptr<ShardedAverager>> ranks;
  for (int64_t r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<ShardedAverager>(
        r, 2, std::vector<LocalShard>{{at::full({2}, 7.0f), spec}}, testing::smallChunkOptions()));
  }
  saveCheckpoint(ckpt, {ranks[0].get(), ranks[1].get()});
  RankManifest manifest = readManifest(ckpt);
  const std::string path = ckpt + "/" + manifest.files[1].name;
  std::string bytes = testing::readFileBytes(path);
  {
    const TensorFileReader reader(path);
    bytes[reader.header().dataOffset + reader.entry("w").begin] ^= static_cast<char>(0xff);
  }
  testing::writeFileBytes(path, bytes);
  manifest.files[1].size = fs::file_size(path);
  manifest.files[1].checksum = fileChecksum(path);
  writeManifest(ckpt, manifest);
  ASSERT_NO_THROW(verifyRankFiles(ckpt)) << "the manifest must pass, as in the issue";

  const std::string named = path + ": tensor 'w' fails its checksum";
  EXPECT_VALUE_ERROR(inspectCheckpoint(ckpt), named);
  EXPECT_VALUE_ERROR(exportCheckpoint(ckpt, dir.file("out.safetensors")), named);
  EXPECT_VALUE_ERROR(reshardCheckpoint(ckpt, dir.file("w1"), 1), named);
  EXPECT_VALUE_ERROR(loadCheckpoint(ckpt, *ranks[1]), named);
  // Nothing written: no export, no temp file, no reshard folder.
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(dir.path()))
    left.push_back(entry.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{"ckpt"});
}

// A rank file's Averager state metadata (here a NaN last decay), re-signed
// in the manifest, is refused by the tools as loadCheckpoint refuses it: a
// reshard would otherwise copy it into every new rank file.
TEST(ShardedBadInputTest, RankFileStateMetadataThatLoadingRefusesIsRefusedByTheTools) {
  SavedJob saved;
  TensorFile file = readTensorFile(saved.rankFile(1));
  file.metadata["shardema.last_decay"] = "nan";
  writeTensorFile(saved.rankFile(1), file);
  saved.rerecord(1);
  const std::string named = saved.rankFile(1) + ": Averager state: shardema.last_decay";
  expectAllRefuse(saved, named);
  EXPECT_VALUE_ERROR(loadCheckpoint(saved.ckpt(), *saved.job.ranks[1].averager),
                     "shardema.last_decay");
  EXPECT_FALSE(fs::exists(saved.dir.file("out")));
  EXPECT_FALSE(fs::exists(saved.dir.file("w2")));
}

TEST(ShardedBadInputTest, ManifestRefusesOutOfRangeIntegersAndUnsafeNames) {
  SavedJob saved;
  const std::string text = testing::readFileBytes(saved.ckpt() + "/manifest.json");
  nlohmann::json manifest = nlohmann::json::parse(text);
  nlohmann::json bad = manifest;
  bad["step"] = uint64_t{9223372036854775808u};  // INT64_MAX + 1 would wrap negative
  EXPECT_VALUE_ERROR(RankManifest::fromJson(bad.dump()), "'step'");
  for (const std::string name :
       {"../rank_00001.x.safetensors", "rank_00001/../x.safetensors", "rank_00001..safetensors",
        "rank_00002.x.safetensors", "rank_000011.safetensors", "rank_00001.x.bin"}) {
    bad = manifest;
    bad["files"][1]["name"] = name;
    EXPECT_VALUE_ERROR(RankManifest::fromJson(bad.dump()), "files[1]");
  }
  bad = manifest;
  bad["files"][1]["name"] = "rank_00001.safetensors";  // the older fixed name is still read
  EXPECT_EQ(RankManifest::fromJson(bad.dump()).files[1].name, "rank_00001.safetensors");
}

// LocalShard::splitDim must name a dim > 0 of the spec, and the local piece
// with that dim moved first must fit the spec's other dims.
TEST(ShardedBadInputTest, ASplitDimThatDoesNotFitThePieceIsRefusedNamingTheTensor) {
  auto shard = [](at::Tensor local, int64_t splitDim) {
    LocalShard out{std::move(local), shard::fsdp2Spec("w", {6, 4}, at::kFloat, 2)};
    out.splitDim = splitDim;
    return std::vector<LocalShard>{out};
  };
  EXPECT_NO_THROW(ShardedAverager(0, 2, shard(at::zeros({4, 3}), 1)));
  EXPECT_VALUE_ERROR(ShardedAverager(0, 2, shard(at::zeros({4, 3}), 2)),
                     "tensor 'w' has splitDim 2 but a spec of 2 dims");
  EXPECT_VALUE_ERROR(ShardedAverager(0, 2, shard(at::zeros({12}), 1)), "tensor 'w'");
  EXPECT_VALUE_ERROR(ShardedAverager(0, 2, shard(at::zeros({3, 4}), 1)),
                     "does not fit its spec's shape");
}

// A tied tensor's other names must name nothing else: not a tracked tensor,
// not another alias, not empty; a manifest's may only alias its tensors.
TEST(ShardedBadInputTest, AliasesThatNameSomethingElseAreRefusedNamingIt) {
  auto shards = [](std::vector<std::string> aliasesOfRows) {
    std::vector<LocalShard> out = shardsFromFullTensors(
        {{"rows", at::zeros({4, 2})}, {"bias", at::zeros({2})}}, shard::LayoutKind::kFsdp2, 0, 1);
    out[0].aliases = std::move(aliasesOfRows);
    return out;
  };
  EXPECT_VALUE_ERROR(ShardedAverager(0, 1, shards({"bias"})),
                     "'bias', an alias of 'rows', is already the name");
  EXPECT_VALUE_ERROR(ShardedAverager(0, 1, shards({"tied", "tied"})), "'tied'");
  EXPECT_VALUE_ERROR(ShardedAverager(0, 1, shards({""})), "an alias of 'rows' is empty");
  EXPECT_EQ(ShardedAverager(0, 1, shards({"tied"})).aliases().at("rows"),
            std::vector<std::string>{"tied"});
  SavedJob saved;
  nlohmann::json manifest =
      nlohmann::json::parse(testing::readFileBytes(saved.ckpt() + "/manifest.json"));
  EXPECT_EQ(RankManifest::fromJson(manifest.dump()).aliases.size(), 0u) << "none written";
  manifest["aliases"] = {{"big", {"big_tied"}}};
  EXPECT_EQ(RankManifest::fromJson(manifest.dump()).aliases.at("big"),
            std::vector<std::string>{"big_tied"});
  manifest["aliases"] = {{"nothing", {"x"}}};
  EXPECT_VALUE_ERROR(RankManifest::fromJson(manifest.dump()), "'nothing', which is no tensor");
  manifest["aliases"] = {{"big", {"rows"}}};
  EXPECT_VALUE_ERROR(RankManifest::fromJson(manifest.dump()), "'rows', an alias of 'big'");
  manifest["aliases"] = {{"big", "big_tied"}};
  EXPECT_VALUE_ERROR(RankManifest::fromJson(manifest.dump()), "not a list of names");
}

}  // namespace
}  // namespace shardema
