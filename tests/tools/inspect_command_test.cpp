// `shardema inspect` on a file and on a checkpoint folder (written by hand
// from the format contract); errors are one line with status 2.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/averager.h"
#include "shardema/core/checksum.h"
#include "shardema/core/decay_schedule.h"
#include "shardema/core/tensor_file.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "support/value_error.h"
#include "tools/checkpoint_cli_fixture.h"

namespace shardema {
namespace {

using testing::HandCheckpoint;
using testing::runCli;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(InspectCommandTest, ListsAFilesTensorsMetadataAndChecksum) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  const std::string file = dir.file("ckpt/" + HandCheckpoint::name(0));
  const auto result = runCli("inspect " + file);
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_TRUE(has(result.out, "2 tensors")) << result.out;
  EXPECT_TRUE(has(result.out, "xxh64 " + checksumHex(fileChecksum(file)))) << result.out;
  EXPECT_TRUE(has(result.out, "tensor w F32 [4]")) << result.out;
  EXPECT_TRUE(has(result.out, "tensor b F32 [2]")) << result.out;
  EXPECT_TRUE(has(result.out, "metadata shardema.step = 42")) << result.out;
  EXPECT_TRUE(has(result.out, "tensor checksums ok")) << result.out;
}

// A single file has no manifest: its own per-tensor checksums are what
// catch a flipped data byte, and inspect names the file and the tensor.
TEST(InspectCommandTest, AFlippedByteInASingleFileNamesTheTensor) {
  testing::TempDir dir;
  const std::string path = dir.file("ema.safetensors");
  TensorFile file;
  file.tensors.emplace_back("w", at::arange(8, at::kFloat));
  file.tensors.emplace_back("b", at::arange(4, at::kFloat));
  writeTensorFile(path, file);
  std::string bytes = testing::readFileBytes(path);
  bytes[bytes.size() - 3] ^= 0x01;  // inside "b", the last tensor
  testing::writeFileBytes(path, bytes);
  const auto result = runCli("inspect " + path);
  EXPECT_EQ(result.status, 2) << result.out;
  EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
  EXPECT_TRUE(has(result.err, path + ": tensor 'b' fails its checksum")) << result.err;
}

TEST(InspectCommandTest, ValidatesACheckpointFolderAgainstItsManifest) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  const auto result = runCli("inspect " + dir.file("ckpt"));
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_TRUE(has(result.out, "step 42, world size 2, 2 tensors")) << result.out;
  EXPECT_TRUE(has(result.out, "rank 1 " + HandCheckpoint::name(1))) << result.out;
  EXPECT_TRUE(has(result.out, "tensor w fsdp2 Float [3, 2] ranges [0, 4) [4, 6)")) << result.out;
  EXPECT_EQ(result.out.find(" ok\n") != std::string::npos, true) << result.out;
}

// The issue's reproduction: a data byte flipped in rank 1's "b" and the
// manifest re-signed with the file's new size and XXH64. inspect once
// passed it; it now runs each tensor's checksum, as loading does.
TEST(InspectCommandTest, AFlippedDataByteUnderAReSignedManifestNamesTheFileAndTensor) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  const std::string rank1 = testing::flipDataByteUnderAReSignedManifest(dir.file("ckpt"), 1, "b");
  const auto result = runCli("inspect " + dir.file("ckpt"));
  EXPECT_EQ(result.status, 2) << result.out;
  EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
  EXPECT_TRUE(has(result.err, rank1 + ": tensor 'b' fails its checksum")) << result.err;
  EXPECT_EQ(result.out, "") << "nothing reported as sound";
}

// `shardema inspect` on an Averager state refuses what Averager::load
// refuses, through the same checks (checkAveragerStateMetadata): each row
// edits one key of a real saved file and writes it again (writeTensorFile
// signs the tensors anew; no checksum covers the metadata), so the edit
// reaches the metadata checks. Once inspect passed them all with status 0.
TEST(InspectCommandTest, AnAveragerStateThatLoadRefusesIsRefusedNamingTheKey) {
  testing::TempDir dir;
  auto tracked = [] {
    return std::vector<TrackedTensor>{{"w", at::full({2}, 7.0f), TrackRole::kAverage},
                                      {"b", at::zeros({3}), TrackRole::kCopy}};
  };
  Averager saved(tracked());
  saved.update(1);
  saved.fence();
  const std::string good = dir.file("good.safetensors");
  saved.save(good);
  ASSERT_EQ(runCli("inspect " + good).status, 0) << runCli("inspect " + good).err;
  ASSERT_NO_THROW(Averager(tracked()).load(good));
  auto schedule = nlohmann::json::parse(DecaySchedule::constant().toJson());
  schedule["decay"] = 2;
  struct Edit {
    std::string key;
    std::string value;  // empty: the key removed
    std::string named;  // in both errors
  };
  const std::vector<Edit> edits = {
      {"shardema.step", "-5", "shardema.step"},
      {"shardema.step", "abc", "shardema.step"},
      {"shardema.step", "99999999999999999999", "shardema.step"},
      {"shardema.last_decay", "nan", "shardema.last_decay"},
      {"shardema.last_decay", "1.5", "shardema.last_decay"},
      {"shardema.schedule", schedule.dump(), "shardema.schedule: DecaySchedule::constant: decay"},
      {"shardema.schedule", "{", "shardema.schedule"},
      {"shardema.kind", "averager_statx", "shardema.kind is 'averager_statx', expected"},
      {"shardema.kind", "deployable_weights", "shardema.kind is 'deployable_weights', expected"},
      {"shardema.kind", "", "metadata key 'shardema.kind' is missing"},
      {"shardema.roles", "[\"average\"]", "shardema.roles is not a JSON object"},
      {"shardema.roles", R"({"w":"averagex","b":"copy"})", "shardema.roles: tensor 'w'"},
      {"shardema.roles", R"({"w":1,"b":"copy"})", "shardema.roles: tensor 'w'"},
      {"shardema.initialized", "yes", "shardema.initialized"},
      {"shardema.initialized", "", "metadata key 'shardema.initialized' is missing"},
  };
  const TensorFile original = readTensorFile(good);
  for (const Edit& edit : edits) {
    SCOPED_TRACE(edit.key + "=" + edit.value);
    TensorFile file = original;
    if (edit.value.empty()) {
      file.metadata.erase(edit.key);
    } else {
      file.metadata[edit.key] = edit.value;
    }
    const std::string path = dir.file("edited.safetensors");
    writeTensorFile(path, file);
    const auto result = runCli("inspect " + path);
    EXPECT_NE(result.status, 0);
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
    EXPECT_TRUE(has(result.err, path + ": ")) << result.err;
    EXPECT_TRUE(has(result.err, edit.named)) << result.err;
    Averager fresh(tracked());
    EXPECT_VALUE_ERROR(fresh.load(path), edit.named);
  }
}

// Edits to values that are valid on their own: a copied tensor's role made
// "average", another schedule. Averager::load refuses both by comparing with
// the Averager it loads into (its roles, its schedule), which inspect does
// not have; inspect once passed them with status 0. The state's own
// checksum of its keys (shardema.state_xxh64, checkAveragerStateMetadata,
// the check both make) refuses both the same way, naming the key.
TEST(InspectCommandTest, AnAveragerStateWithEditedRolesOrScheduleIsRefusedAsLoadRefusesIt) {
  testing::TempDir dir;
  auto tracked = [] {
    return std::vector<TrackedTensor>{{"w", at::full({2}, 7.0f), TrackRole::kAverage},
                                      {"b", at::zeros({3}), TrackRole::kCopy}};
  };
  Averager saved(tracked());
  saved.update(1);
  saved.fence();
  const std::string good = dir.file("good.safetensors");
  saved.save(good);
  const TensorFile original = readTensorFile(good);
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"shardema.roles", R"({"b":"average","w":"average"})"},
      {"shardema.schedule", DecaySchedule::constant({0.5}).toJson()},
      {"shardema.step", "2"},
  };
  for (const auto& [key, value] : edits) {
    SCOPED_TRACE(key + "=" + value);
    TensorFile file = original;
    file.metadata[key] = value;
    const std::string path = dir.file("edited.safetensors");
    writeTensorFile(path, file);
    const auto result = runCli("inspect " + path);
    EXPECT_EQ(result.status, 2);
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
    EXPECT_TRUE(has(result.err, path + ": ")) << result.err;
    EXPECT_TRUE(has(result.err, "shardema.state_xxh64")) << result.err;
    EXPECT_TRUE(has(result.err, key)) << result.err;
    Averager fresh(tracked());
    EXPECT_VALUE_ERROR(fresh.load(path), "shardema.state_xxh64");
    EXPECT_EQ(fresh.step(), 0) << "a refused load changes nothing";
  }
  // A state without the key (older files, other writers) is not checked.
  TensorFile unsigned_ = original;
  unsigned_.metadata.erase("shardema.state_xxh64");
  writeTensorFile(dir.file("unsigned.safetensors"), unsigned_);
  EXPECT_EQ(runCli("inspect " + dir.file("unsigned.safetensors")).status, 0);
  EXPECT_NO_THROW(Averager(tracked()).load(dir.file("unsigned.safetensors")));
}

// A kind no shardema writer uses is an edited or foreign file.
TEST(InspectCommandTest, AnUnknownKindIsRefused) {
  testing::TempDir dir;
  TensorFile file;
  file.tensors.emplace_back("w", at::arange(4, at::kFloat));
  file.metadata["shardema.kind"] = "weights_of_some_kind";
  writeTensorFile(dir.file("x.safetensors"), file);
  const auto result = runCli("inspect " + dir.file("x.safetensors"));
  EXPECT_EQ(result.status, 2);
  EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
  EXPECT_TRUE(has(result.err, "shardema.kind is 'weights_of_some_kind', not a kind")) << result.err;
}

TEST(InspectCommandTest, ErrorsAreOneLineNamingTheFileWithStatus2) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  auto expectError = [&](const std::string& args, const std::string& named) {
    const auto result = runCli(args);
    EXPECT_EQ(result.status, 2) << args << ": " << result.err;
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
    EXPECT_TRUE(has(result.err, "shardema inspect: ")) << result.err;
    EXPECT_TRUE(has(result.err, named)) << result.err;
  };
  expectError("inspect", "exactly one");
  expectError("inspect " + dir.file("missing"), dir.file("missing"));
  // Unknown tensor in a rank file (still matching the manifest's checksum
  // would need a rewrite: here the checksum catches it first).
  const std::string rank0 = dir.file("ckpt/" + HandCheckpoint::name(0));
  const std::string bytes = testing::readFileBytes(rank0);
  testing::writeFileBytes(rank0, bytes.substr(0, bytes.size() - 4));
  expectError("inspect " + dir.file("ckpt"), HandCheckpoint::name(0) + ": size");
  expectError("inspect " + rank0, HandCheckpoint::name(0));
  std::filesystem::remove(dir.file("ckpt/manifest.json"));
  expectError("inspect " + dir.file("ckpt"), "manifest.json missing");
}

// A symlink loop is named as one, not as a missing path; the same for a
// checkpoint whose manifest is a loop.
TEST(InspectCommandTest, ASymlinkLoopIsNamedAsOne) {
  testing::TempDir dir;
  auto expectError = [&](const std::string& args, const std::string& named) {
    const testing::CliResult result = runCli(args);
    EXPECT_EQ(result.status, 2) << args;
    EXPECT_TRUE(has(result.err, named)) << result.err;
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
  };
  const std::string loop = dir.file("loop.safetensors");
  ASSERT_EQ(::symlink(loop.c_str(), loop.c_str()), 0);
  expectError("inspect " + loop, "a loop of symbolic links");
  testing::HandCheckpoint::write(dir.file("ckpt"));
  const std::string manifest = dir.file("ckpt") + "/manifest.json";
  std::remove(manifest.c_str());
  ASSERT_EQ(::symlink(manifest.c_str(), manifest.c_str()), 0);
  expectError("inspect " + dir.file("ckpt"), "manifest.json: Too many levels of symbolic links");
}

}  // namespace
}  // namespace shardema
