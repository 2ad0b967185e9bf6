// A per-rank checkpoint of an EMA of several profiles (moreSchedules) under
// the offline tools: exportCheckpoint writes the profile asked for, byte for
// byte what the online exportWeights(..., profile) writes and the
// single-process reference's EMA of that profile; a reshard keeps every
// profile, so loadCheckpoint at another world size restores them all; a
// profile that does not exist and a rank file whose profile tensors are
// wrong are refused naming them.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "lib/sharded_fixture.h"
#include "shardema/core/checksum.h"
#include "shardema/core/tensor_file.h"
#include "shardema/detail/rank_manifest.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/thread_ranks.h"
#include "support/value_error.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kWorld = 3;
constexpr int64_t kSteps = 6;

// Three profiles: the fixture's warmup, a constant decay and a power
// function, so each profile's EMA differs from the others' at every step.
AveragerOptions threeProfiles() {
  AveragerOptions options = testing::smallChunkOptions();
  options.moreSchedules = {DecaySchedule::constant({0.5}), DecaySchedule::powerFunction({0.1})};
  return options;
}

// The index of tensor `name` in `file`, or -1.
int indexOf(const TensorFile& file, const std::string& name) {
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    if (file.tensors[i].first == name) return static_cast<int>(i);
  }
  return -1;
}

struct ProfilesJob {
  ProfilesJob()
      : job(testing::unevenModel(at::kBFloat16, true), shard::LayoutKind::kFsdp2, kWorld,
            threeProfiles()) {
    job.run(1, kSteps);
    saveCheckpoint(ckpt(), job.averagers());
  }
  std::string ckpt() const { return dir.file("ckpt"); }
  std::string rankFile(int r) const { return ckpt() + "/" + readManifest(ckpt()).files[r].name; }
  void rerecord(int r) const {
    RankManifest manifest = readManifest(ckpt());
    manifest.files[r].size = fs::file_size(rankFile(r));
    manifest.files[r].checksum = fileChecksum(rankFile(r));
    writeManifest(ckpt(), manifest);
  }

  testing::TempDir dir;
  testing::PerTensorJob job;
};

// The exported tensors of `profile` against the reference's EMA of it.
void expectProfileExported(const std::string& file, const testing::PerTensorJob& job, int profile) {
  const TensorFile exported = readTensorFile(file);
  ASSERT_EQ(exported.tensors.size(), job.model.size());
  for (const auto& [name, tensor] : exported.tensors) {
    // Floating copies are exported as float32 too.
    const at::Tensor& ema = job.reference.ema(name, profile);
    const at::Tensor want = at::isFloatingType(ema.scalar_type()) ? ema.to(at::kFloat) : ema;
    EXPECT_TRUE(testing::sameTensor(tensor, want)) << name << " of profile " << profile;
  }
  EXPECT_EQ(exported.metadata.at("shardema.schedule"), job.reference.schedule(profile).toJson());
}

TEST(ShardedProfilesTest, ExportWritesTheProfileAskedForAsTheOnlineExportDoes) {
  ProfilesJob saved;
  EXPECT_EQ(checkpointSchedules(saved.ckpt()).size(), 3u);
  for (int p = 0; p < 3; ++p) {
    EXPECT_EQ(checkpointSchedules(saved.ckpt())[p], saved.job.reference.schedule(p));
  }
  // The online export of each profile from the same ranks, for comparison.
  testing::runThreadRanks(kWorld, [&](shard::Communicator& comm) {
    const ShardedAverager& averager = *saved.job.ranks[comm.rank()].averager;
    for (int p = 0; p < 3; ++p) {
      averager.exportWeights(comm, saved.dir.file("online_" + std::to_string(p)), at::kFloat, {},
                             std::nullopt, p);
    }
    averager.exportWeights(comm, saved.dir.file("online_hf"), at::kBFloat16, {}, int64_t{200}, 2);
  });
  for (int p = 0; p < 3; ++p) {
    ExportOptions options;
    options.profile = p;
    options.bufferBytes = 24;  // pieces that cut every larger tensor
    const std::string out = saved.dir.file("offline_" + std::to_string(p));
    const ExportSummary summary = exportCheckpoint(saved.ckpt(), out, options);
    EXPECT_EQ(summary.step, kSteps);
    expectProfileExported(out, saved.job, p);
    EXPECT_EQ(testing::readFileBytes(out),
              testing::readFileBytes(saved.dir.file("online_" + std::to_string(p))))
        << "profile " << p;
  }
  // Profiles differ (else the test above could not tell them apart).
  EXPECT_NE(testing::readFileBytes(saved.dir.file("offline_1")),
            testing::readFileBytes(saved.dir.file("offline_2")));
  // With a dtype and Hugging Face's layout: the same files as online.
  ExportOptions hf;
  hf.profile = 2;
  hf.outputDtype = at::kBFloat16;
  hf.maxShardBytes = 200;
  const ExportSummary summary = exportCheckpoint(saved.ckpt(), saved.dir.file("offline_hf"), hf);
  EXPECT_GT(summary.files, 1);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(saved.dir.file("online_hf"))) {
    names.push_back(entry.path().filename());
  }
  ASSERT_EQ(static_cast<int64_t>(names.size()), summary.files + 1);  // + the index
  for (const std::string& name : names) {
    EXPECT_EQ(testing::readFileBytes(saved.dir.file("offline_hf/" + name)),
              testing::readFileBytes(saved.dir.file("online_hf/" + name)))
        << name;
  }
}

TEST(ShardedProfilesTest, AProfileThatDoesNotExistIsRefusedNamingTheCount) {
  ProfilesJob saved;
  const std::string out = saved.dir.file("out");
  for (const int profile : {3, -1}) {
    ExportOptions options;
    options.profile = profile;
    try {
      exportCheckpoint(saved.ckpt(), out, options);
      ADD_FAILURE() << "profile " << profile << " exported";
    } catch (const c10::IndexError& error) {
      const std::string message = error.what_without_backtrace();
      EXPECT_NE(message.find("profile " + std::to_string(profile)), std::string::npos) << message;
      if (profile > 0) {
        EXPECT_NE(message.find("holds 3 profiles (0 to 2)"), std::string::npos) << message;
      }
    }
    EXPECT_FALSE(fs::exists(out));
  }
  // A checkpoint of one profile holds profile 0 alone.
  testing::PerTensorJob one(testing::unevenModel(at::kFloat, false), shard::LayoutKind::kFsdp2, 2);
  one.run(1, 2);
  saveCheckpoint(saved.dir.file("one"), one.averagers());
  EXPECT_EQ(checkpointSchedules(saved.dir.file("one")).size(), 1u);
  ExportOptions options;
  options.profile = 1;
  try {
    exportCheckpoint(saved.dir.file("one"), out, options);
    ADD_FAILURE() << "profile 1 of a one-profile checkpoint exported";
  } catch (const c10::IndexError& error) {
    EXPECT_NE(std::string(error.what_without_backtrace()).find("holds 1 profile (0)"),
              std::string::npos);
  }
}

// W = 3 -> 1 -> 2: each load restores every profile bit for bit, and the
// loaded ranks go on as the reference does.
TEST(ShardedProfilesTest, ReshardKeepsEveryProfile) {
  ProfilesJob saved;
  const auto& model = saved.job.model;
  std::string source = saved.ckpt();
  for (const int64_t world : {int64_t{1}, int64_t{2}}) {
    const std::string out = saved.dir.file("w" + std::to_string(world));
    ExportOptions small;
    small.bufferBytes = 24;
    reshardCheckpoint(source, out, world, small);
    EXPECT_EQ(checkpointSchedules(out), checkpointSchedules(saved.ckpt()));
    std::vector<testing::RankModel> loaded =
        testing::makeRanks(model, shard::LayoutKind::kFsdp2, world, threeProfiles());
    for (auto& rank : loaded) loadCheckpoint(out, *rank.averager);
    for (int p = 0; p < 3; ++p) {
      for (size_t i = 0; i < model.size(); ++i) {
        std::vector<at::Tensor> parts;
        for (const auto& rank : loaded) {
          parts.push_back(rank.averager->averager().ema(model[i].name, p).reshape({-1}));
        }
        EXPECT_TRUE(testing::sameTensor(at::cat(parts),
                                        saved.job.reference.ema(model[i].name, p).reshape({-1})))
            << model[i].name << " of profile " << p << " at world size " << world;
      }
    }
    // A load into another number of profiles is refused, naming both.
    std::vector<testing::RankModel> two =
        testing::makeRanks(model, shard::LayoutKind::kFsdp2, world, [] {
          AveragerOptions options = threeProfiles();
          options.moreSchedules.pop_back();
          return options;
        }());
    EXPECT_VALUE_ERROR(loadCheckpoint(out, *two[0].averager), "3 profiles");
    // The resharded checkpoint exports each profile as the original does.
    for (int p = 0; p < 3; ++p) {
      ExportOptions options;
      options.profile = p;
      exportCheckpoint(out, saved.dir.file("re_" + std::to_string(p)), options);
      expectProfileExported(saved.dir.file("re_" + std::to_string(p)), saved.job, p);
    }
    source = out;
  }
}

TEST(ShardedProfilesTest, WrongProfileTensorsAreRefusedNamingTheTensor) {
  {  // a profile tensor missing
    ProfilesJob saved;
    TensorFile file = readTensorFile(saved.rankFile(1));
    const int at = indexOf(file, "shardema.profile_2/big");
    ASSERT_GE(at, 0);
    file.tensors.erase(file.tensors.begin() + at);
    writeTensorFile(saved.rankFile(1), file);
    saved.rerecord(1);
    EXPECT_VALUE_ERROR(inspectCheckpoint(saved.ckpt()), "'shardema.profile_2/big'");
    EXPECT_VALUE_ERROR(reshardCheckpoint(saved.ckpt(), saved.dir.file("w1"), 1),
                       "'shardema.profile_2/big'");
    EXPECT_FALSE(fs::exists(saved.dir.file("w1")));
  }
  {  // a profile of a copied tensor, which every profile shares
    ProfilesJob saved;
    TensorFile file = readTensorFile(saved.rankFile(0));
    const int at = indexOf(file, "copied");
    ASSERT_GE(at, 0);
    file.tensors.emplace_back("shardema.profile_1/copied", file.tensors[at].second.clone());
    writeTensorFile(saved.rankFile(0), file);
    saved.rerecord(0);
    EXPECT_VALUE_ERROR(exportCheckpoint(saved.ckpt(), saved.dir.file("out")),
                       "'shardema.profile_1/copied'");
    EXPECT_FALSE(fs::exists(saved.dir.file("out")));
  }
  {  // a profile the metadata does not record, and another dtype
    ProfilesJob saved;
    TensorFile file = readTensorFile(saved.rankFile(2));
    const int at = indexOf(file, "shardema.profile_1/prime");
    ASSERT_GE(at, 0);
    file.tensors.emplace_back("shardema.profile_3/prime", file.tensors[at].second.clone());
    writeTensorFile(saved.rankFile(2), file);
    saved.rerecord(2);
    EXPECT_VALUE_ERROR(inspectCheckpoint(saved.ckpt()), "'shardema.profile_3/prime'");
    file.tensors.pop_back();
    file.tensors[at].second = file.tensors[at].second.to(at::kDouble);
    writeTensorFile(saved.rankFile(2), file);
    saved.rerecord(2);
    EXPECT_VALUE_ERROR(inspectCheckpoint(saved.ckpt()), "'shardema.profile_1/prime'");
  }
}

}  // namespace
}  // namespace shardema
