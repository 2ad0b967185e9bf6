#include "shardema/core/posthoc_snapshot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/posthoc_snapshot_fixture.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "support/command_output.h"
#include "support/temp_dir.h"
#include "support/value_error.h"

namespace shardema {
namespace {

using namespace snapshot_test;  // NOLINT: the fixture helpers
namespace fs = std::filesystem;

TEST(PosthocSnapshotTest, NamesFollowTheContract) {
  EXPECT_EQ(snapshotFileName(0, 10), "0.10.safetensors");
  EXPECT_EQ(snapshotFileName(12, 5000), "12.5000.safetensors");
  EXPECT_EQ(rankFolderName(3), "rank_00003");
  EXPECT_EQ(rankFolderName(0), "rank_00000");
  EXPECT_EQ(rankFolderName(123456), "rank_123456");
}

TEST(PosthocSnapshotTest, ParsesGoodNames) {
  int64_t index = -7;
  int64_t step = -7;
  ASSERT_TRUE(parseSnapshotFileName("0.10.safetensors", &index, &step));
  EXPECT_EQ(index, 0);
  EXPECT_EQ(step, 10);
  ASSERT_TRUE(parseSnapshotFileName("12.5000.safetensors", &index, &step));
  EXPECT_EQ(index, 12);
  EXPECT_EQ(step, 5000);
  ASSERT_TRUE(parseSnapshotFileName("3.9223372036854775807.safetensors", &index, &step));
  EXPECT_EQ(step, INT64_MAX);
  EXPECT_TRUE(parseSnapshotFileName("1.2.safetensors", nullptr, nullptr));
}

TEST(PosthocSnapshotTest, RefusesBadNames) {
  const char* bad[] = {"a.1.safetensors",
                       "0.-1.safetensors",
                       "-0.1.safetensors",
                       "+0.1.safetensors",
                       "0.+1.safetensors",
                       "0.1.pt",
                       "0.1.safetensors.tmp",
                       "0.safetensors",
                       "0.1.2.safetensors",
                       ".1.safetensors",
                       "0..safetensors",
                       "0.1 .safetensors",
                       " 0.1.safetensors",
                       "00.1.safetensors",
                       "0.010.safetensors",
                       "0.9223372036854775808.safetensors",
                       "99999999999999999999.1.safetensors",
                       ".safetensors",
                       ""};
  for (const char* name : bad) {
    int64_t index = -7;
    int64_t step = -7;
    EXPECT_FALSE(parseSnapshotFileName(name, &index, &step)) << name;
    EXPECT_EQ(index, -7) << name;
    EXPECT_EQ(step, -7) << name;
  }
}

TEST(PosthocSnapshotTest, MetadataHasTheDocumentedKeys) {
  SnapshotInfo info = fullInfo(2, 40, 0.05);
  auto metadata = snapshotMetadata(info);
  EXPECT_EQ(metadata.at("shardema.kind"), "posthoc_snapshot");
  EXPECT_EQ(metadata.at("shardema.step"), "40");
  EXPECT_EQ(metadata.at("shardema.profile_index"), "2");
  char gamma[40];
  std::snprintf(gamma, sizeof(gamma), "%.17g", info.gamma);
  EXPECT_EQ(metadata.at("shardema.gamma"), gamma);
  EXPECT_EQ(metadata.count("shardema.rank"), 0u);
  EXPECT_EQ(metadata.count("shardema.world_size"), 0u);
  EXPECT_EQ(metadata.count("shardema.layout"), 0u);

  metadata = snapshotMetadata(shardInfo(2, 40, 0.05, 1, 4, "{\"a\":1}"));
  EXPECT_EQ(metadata.at("shardema.rank"), "1");
  EXPECT_EQ(metadata.at("shardema.world_size"), "4");
  EXPECT_EQ(metadata.at("shardema.layout"), "{\"a\":1}");
}

TEST(PosthocSnapshotTest, RoundTripsThroughTensorFile) {
  testing::TempDir dir;
  const SnapshotInfo info = fullInfo(1, 20, 0.10);
  const at::Tensor bf16 = at::arange(-8, 8, at::kFloat).mul(0.3).to(at::kBFloat16);
  const at::Tensor wide = at::arange(12, at::kDouble).div(7.0).reshape({3, 4}).t();  // strided
  const at::Tensor counter = at::tensor({int64_t{5}, int64_t{-3}});
  const at::Tensor mask = at::tensor({1, 0, 1}).to(at::kBool);
  const std::string path = dir.file(snapshotFileName(1, 20));
  writeSnapshot(path, {{"bf16", bf16}, {"wide", wide}, {"counter", counter}, {"mask", mask}}, info);

  const TensorFile file = readTensorFile(path);
  ASSERT_EQ(file.tensors.size(), 4u);
  EXPECT_EQ(file.tensors[0].first, "bf16");
  EXPECT_EQ(file.tensors[1].first, "wide");
  EXPECT_EQ(file.at("bf16").scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(file.at("bf16"), bf16.to(at::kFloat)));  // bf16 -> f32 is exact
  EXPECT_EQ(file.at("wide").scalar_type(), at::kFloat);
  EXPECT_EQ(file.at("wide").sizes(), wide.sizes());
  EXPECT_TRUE(at::equal(file.at("wide"), wide.to(at::kFloat)));
  EXPECT_EQ(file.at("counter").scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(file.at("counter"), counter));
  EXPECT_EQ(file.at("mask").scalar_type(), at::kBool);
  EXPECT_TRUE(at::equal(file.at("mask"), mask));

  EXPECT_EQ(file.metadata.at("shardema.kind"), "posthoc_snapshot");
  EXPECT_EQ(file.metadata.at("shardema.format"), "1");
  EXPECT_EQ(file.metadata.at("shardema.step"), "20");
  EXPECT_EQ(file.metadata.at("shardema.profile_index"), "1");
  EXPECT_EQ(file.metadata.at("shardema.sigma_rel"),
            snapshotMetadata(info).at("shardema.sigma_rel"));
  EXPECT_EQ(file.metadata.at("shardema.gamma"), snapshotMetadata(info).at("shardema.gamma"));
  EXPECT_EQ(file.metadata.count("shardema.rank"), 0u);

  const SnapshotInfo back = readSnapshotInfo(path);
  EXPECT_EQ(back.profileIndex, 1);
  EXPECT_EQ(back.step, 20);
  EXPECT_EQ(back.rank, -1);
  EXPECT_EQ(back.worldSize, 0);
  EXPECT_TRUE(back.layoutJson.empty());
}

TEST(PosthocSnapshotTest, GammaAndSigmaRelRoundTripBitExactly) {
  testing::TempDir dir;
  for (double sigmaRel : {0.01, 0.05, 0.1, 0.123456789012345, 0.28}) {
    SnapshotInfo info = fullInfo(0, 7, sigmaRel);
    const std::string path = dir.file(snapshotFileName(0, 7));
    writeSnapshot(path, someTensors(info), info);
    const SnapshotInfo back = readSnapshotInfo(path);
    EXPECT_EQ(back.gamma, info.gamma) << sigmaRel;  // exact, not near
    EXPECT_EQ(back.sigmaRel, info.sigmaRel) << sigmaRel;
  }
}

TEST(PosthocSnapshotTest, ShardedInfoRoundTrips) {
  testing::TempDir dir;
  const SnapshotInfo info = shardInfo(0, 3, 0.05, 1, 2, "{\"fsdp\":2,\"sizes\":[3,4]}");
  const std::string path = dir.file(snapshotFileName(0, 3));
  writeSnapshot(path, someTensors(info), info);
  const SnapshotInfo back = readSnapshotInfo(path);
  EXPECT_EQ(back.rank, 1);
  EXPECT_EQ(back.worldSize, 2);
  EXPECT_EQ(back.layoutJson, info.layoutJson);
  EXPECT_EQ(readTensorFile(path).metadata.at("shardema.layout"), info.layoutJson);
}

// Tensor parallelism's pieces: shardema.split_dims only when there are
// any (files without them stay byte for byte what they were), read back
// exactly, and refused garbled or where it cannot belong.
TEST(PosthocSnapshotTest, SplitDimsRoundTripAndAreValidated) {
  testing::TempDir dir;
  SnapshotInfo info = shardInfo(0, 3, 0.05, 1, 2, "{\"fsdp\":2}");
  writeSnapshot(dir.file(snapshotFileName(0, 3)), someTensors(info), info);
  EXPECT_EQ(readTensorFile(dir.file("0.3.safetensors")).metadata.count("shardema.split_dims"), 0u);
  EXPECT_TRUE(readSnapshotInfo(dir.file("0.3.safetensors")).splitDims.empty());
  info.splitDims = {{"layer.weight", 1}, {"inner", 2}};
  writeSnapshot(dir.file("0.3.safetensors"), someTensors(info), info);
  EXPECT_EQ(readTensorFile(dir.file("0.3.safetensors")).metadata.at("shardema.split_dims"),
            "{\"inner\":2,\"layer.weight\":1}");
  EXPECT_EQ(readSnapshotInfo(dir.file("0.3.safetensors")).splitDims, info.splitDims);
  info.splitDims = {{"w", 0}};
  EXPECT_VALUE_ERROR(writeSnapshot(dir.file("0.4.safetensors"), someTensors(info), info),
                     "splitDims of tensor 'w' must be >= 1");
  SnapshotInfo full = fullInfo(0, 4, 0.05);
  full.splitDims = {{"w", 1}};
  EXPECT_VALUE_ERROR(writeSnapshot(dir.file("0.4.safetensors"), someTensors(full), full),
                     "no splitDims");
  const auto good = snapshotMetadata(shardInfo(0, 10, 0.05, 0, 1));
  for (const char* bad : {"[1]", "{}", "{\"w\":0}", "{\"w\":1.5}", "{\"w\":\"1\"}", "{"}) {
    SCOPED_TRACE(bad);
    auto metadata = good;
    metadata["shardema.split_dims"] = bad;
    EXPECT_VALUE_ERROR(readSnapshotInfo(writeRawSnapshot(dir, "0.10.safetensors", metadata)),
                       "shardema.split_dims");
  }
  auto metadata = snapshotMetadata(fullInfo(0, 10, 0.05));
  metadata["shardema.split_dims"] = "{\"w\":1}";
  EXPECT_VALUE_ERROR(readSnapshotInfo(writeRawSnapshot(dir, "0.10.safetensors", metadata)),
                     "full-copy snapshot");
}

TEST(PosthocSnapshotTest, WriteValidatesInfo) {
  testing::TempDir dir;
  const std::string path = dir.file("0.1.safetensors");
  const Tensors tensors = {{"w", at::ones({2})}};
  SnapshotInfo info = fullInfo(0, 1, 0.05);
  info.step = 0;
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "step");
  info = fullInfo(0, 1, 0.05);
  info.profileIndex = -1;
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "profileIndex");
  info = fullInfo(0, 1, 0.05);
  info.gamma = 0;
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "gamma");
  info.gamma = INFINITY;
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "gamma");
  info = fullInfo(0, 1, 0.05);
  info.sigmaRel = 0.051;
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "sigmaRel");
  info = shardInfo(0, 1, 0.05, 2, 2);
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "worldSize");
  info = shardInfo(0, 1, 0.05, 0, 2, "");
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "layoutJson");
  info = fullInfo(0, 1, 0.05);
  info.worldSize = 2;
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "worldSize");
  info = fullInfo(0, 1, 0.05);
  info.rank = -2;
  EXPECT_VALUE_ERROR(writeSnapshot(path, tensors, info), "rank");
  EXPECT_VALUE_ERROR(writeSnapshot(path, {{"w", at::Tensor()}}, fullInfo(0, 1, 0.05)), "'w'");
  EXPECT_FALSE(fs::exists(path));
}

TEST(PosthocSnapshotTest, ReadRefusesARenamedFile) {
  testing::TempDir dir;
  const SnapshotInfo info = fullInfo(0, 20, 0.05);
  writeSnapshot(dir.file("0.20.safetensors"), someTensors(info), info);
  fs::rename(dir.file("0.20.safetensors"), dir.file("0.10.safetensors"));
  EXPECT_VALUE_ERROR(readSnapshotInfo(dir.file("0.10.safetensors")),
                     "metadata says step 20 but the name says 10");
  EXPECT_VALUE_ERROR(readSnapshotInfo(dir.file("0.10.safetensors")), dir.file("0.10.safetensors"));
  fs::rename(dir.file("0.10.safetensors"), dir.file("4.20.safetensors"));
  EXPECT_VALUE_ERROR(readSnapshotInfo(dir.file("4.20.safetensors")),
                     "metadata says profile index 0 but the name says 4");
  fs::rename(dir.file("4.20.safetensors"), dir.file("ema.safetensors"));
  EXPECT_VALUE_ERROR(readSnapshotInfo(dir.file("ema.safetensors")), "not a snapshot name");
}

TEST(PosthocSnapshotTest, ReadRefusesMissingOrGarbledMetadata) {
  testing::TempDir dir;
  const std::map<std::string, std::string> good = snapshotMetadata(shardInfo(0, 10, 0.05, 0, 1));
  ASSERT_NO_THROW(readSnapshotInfo(writeRawSnapshot(dir, "0.10.safetensors", good)));
  for (const char* key :
       {"shardema.kind", "shardema.step", "shardema.profile_index", "shardema.gamma",
        "shardema.sigma_rel", "shardema.rank", "shardema.world_size", "shardema.layout"}) {
    auto metadata = good;
    metadata.erase(key);
    const std::string path = writeRawSnapshot(dir, "0.10.safetensors", metadata);
    EXPECT_VALUE_ERROR(readSnapshotInfo(path), key);
    EXPECT_VALUE_ERROR(readSnapshotInfo(path), path);
  }
  const std::pair<const char*, const char*> garbled[] = {{"shardema.kind", "deployable"},
                                                         {"shardema.step", "10x"},
                                                         {"shardema.step", "-10"},
                                                         {"shardema.step", "+10"},
                                                         {"shardema.step", ""},
                                                         {"shardema.step", "99999999999999999999"},
                                                         {"shardema.profile_index", "0.0"},
                                                         {"shardema.gamma", "nan"},
                                                         {"shardema.gamma", "inf"},
                                                         {"shardema.gamma", " 6.9"},
                                                         {"shardema.gamma", "0x1p3"},
                                                         {"shardema.gamma", "-6.9"},
                                                         {"shardema.gamma", "6.9abc"},
                                                         {"shardema.sigma_rel", "0.3"},
                                                         {"shardema.rank", "1"},
                                                         {"shardema.world_size", "zero"},
                                                         {"shardema.layout", ""}};
  for (const auto& [key, value] : garbled) {
    auto metadata = good;
    metadata[key] = value;
    const std::string path = writeRawSnapshot(dir, "0.10.safetensors", metadata);
    SCOPED_TRACE(std::string(key) + "=" + value);
    EXPECT_VALUE_ERROR(readSnapshotInfo(path), key);
    EXPECT_VALUE_ERROR(readSnapshotInfo(path), path);
  }
  EXPECT_VALUE_ERROR(readSnapshotInfo(dir.file("9.9.safetensors")), dir.file("9.9.safetensors"));
}

constexpr const char* kNumpyReader = R"PY(
import json, struct, sys
import numpy as np
path, gamma, base = sys.argv[1], sys.argv[2], float(sys.argv[3])
blob = open(path, "rb").read()
(n,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8:8 + n].decode("utf-8"))
meta = header.pop("__metadata__")
assert meta["shardema.kind"] == "posthoc_snapshot", meta
assert meta["shardema.gamma"] == gamma, (meta["shardema.gamma"], gamma)
assert float(meta["shardema.gamma"]).hex() == float(gamma).hex()
entry = header["layer.weight"]
assert entry["dtype"] == "F32" and entry["shape"] == [2, 3], entry
begin, end = entry["data_offsets"]
values = np.frombuffer(blob[8 + n + begin:8 + n + end], dtype="<f4").reshape(2, 3)
want = (np.arange(6, dtype=np.float64) + base).astype(np.float32).reshape(2, 3)
assert np.array_equal(values, want), values
print("OK")
)PY";

TEST(PosthocSnapshotTest, NumpyReadsASnapshot) {
  const std::string python = SHARDEMA_TEST_PYTHON;
  testing::TempDir dir;
  const SnapshotInfo info = fullInfo(2, 30, 0.10);
  writeIn(dir.path(), info);
  std::ofstream(dir.file("reader.py")) << kNumpyReader;
  const std::string command = "'" + python + "' '" + dir.file("reader.py") + "' '" +
                              dir.file(snapshotFileName(2, 30)) + "' '" +
                              snapshotMetadata(info).at("shardema.gamma") + "' 2030 2>&1";
  const testing::CommandResult result = testing::runCommand(command);
  EXPECT_EQ(result.exitCode, 0) << result.output;
  EXPECT_EQ(result.output, "OK\n");
}

}  // namespace
}  // namespace shardema
