// Per-rank checkpoints: save/load round trip, the manifest against
// independent readers (nlohmann, std::filesystem, xxhsum), resharding to
// other world sizes and export, each against the single-process EMA.
#include "shardema/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lib/sharded_fixture.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/sharded_averager.h"
#include "support/command_output.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;
using testing::PerTensorJob;

// Loads `dir` into fresh ranks (initial values, so a load that did nothing
// shows) of `kind` over `worldSize` and returns them.
std::vector<testing::RankModel> loadInto(const std::vector<testing::ModelTensor>& model,
                                         shard::LayoutKind kind, int64_t worldSize,
                                         const std::string& dir) {
  std::vector<testing::RankModel> ranks = testing::makeRanks(model, kind, worldSize);
  for (auto& rank : ranks) loadCheckpoint(dir, *rank.averager);
  return ranks;
}

TEST(ShardedCheckpointTest, SaveLoadRoundTripContinuesIdentically) {
  testing::TempDir dir;
  PerTensorJob job(testing::unevenModel(at::kBFloat16, true), shard::LayoutKind::kFsdp2, 3);
  job.run(1, 7);
  saveCheckpoint(dir.path(), job.averagers());
  std::vector<testing::RankModel> loaded =
      loadInto(job.model, shard::LayoutKind::kFsdp2, 3, dir.path());
  testing::expectEqualsReference(job.reference, job.ranks[0].averager->layout(),
                                 testing::unionOfRanks(testing::averagersOf(loaded)), "loaded");
  for (size_t r = 0; r < loaded.size(); ++r) {
    const Averager& a = loaded[r].averager->averager();
    const Averager& b = job.ranks[r].averager->averager();
    EXPECT_EQ(a.step(), 7);
    EXPECT_EQ(a.initialized(), b.initialized());
    EXPECT_EQ(a.lastDecay(), b.lastDecay());
  }
  // Resumed ranks and the reference keep agreeing bit for bit.
  job.ranks = std::move(loaded);
  job.run(8, 10);
  testing::expectEqualsReference(job.reference, job.ranks[0].averager->layout(),
                                 testing::unionOfRanks(job.averagers()), "resumed");
}

TEST(ShardedCheckpointTest, ManifestRecordsSizesAndXxh64OfEveryRankFile) {
  testing::TempDir dir;
  PerTensorJob job(testing::unevenModel(at::kFloat, true), shard::LayoutKind::kFsdp2, 4);
  job.run(1, 3);
  saveCheckpoint(dir.path(), job.averagers());
  const nlohmann::json manifest =
      nlohmann::json::parse(testing::readFileBytes(dir.file("manifest.json")));
  EXPECT_EQ(manifest["format"], 1);
  EXPECT_EQ(manifest["kind"], "sharded_averager_state");
  EXPECT_EQ(manifest["step"], 3);
  EXPECT_EQ(manifest["world_size"], 4);
  EXPECT_EQ(manifest["schedule"].dump(),
            nlohmann::json::parse(job.reference.schedule().toJson()).dump());
  EXPECT_EQ(manifest["layout_fingerprint"], job.ranks[0].averager->layout().fingerprint());
  EXPECT_EQ(manifest["layout"]["tensors"].size(), job.model.size());
  ASSERT_EQ(manifest["files"].size(), 4u);
  for (int r = 0; r < 4; ++r) {
    const nlohmann::json& file = manifest["files"][r];
    // rank_XXXXX.step_S.ID.safetensors, one ID for the whole save.
    const std::string name = file["name"].get<std::string>();
    char prefix[64];
    std::snprintf(prefix, sizeof(prefix), "rank_%05d.step_3.", r);
    EXPECT_EQ(name.rfind(prefix, 0), 0u) << name;
    EXPECT_EQ(name.size(), std::strlen(prefix) + 16 + std::strlen(".safetensors")) << name;
    EXPECT_EQ(name.substr(name.size() - 28),
              manifest["files"][0]["name"].get<std::string>().substr(
                  manifest["files"][0]["name"].get<std::string>().size() - 28));
    EXPECT_EQ(file["size"].get<uint64_t>(), fs::file_size(dir.file(name)));
    // xxhsum -H64 prints "<16 hex digits>  <file>".
    const std::string xxhsum =
        testing::runCommand("xxhsum -H64 '" + dir.file(name) + "' 2>/dev/null").output;
    if (!xxhsum.empty()) {
      EXPECT_EQ(xxhsum.substr(0, 16), file["xxh64"].get<std::string>());
    }
    const TensorFile rankFile = readTensorFile(dir.file(name));
    EXPECT_EQ(rankFile.metadata.at("shardema.rank"), std::to_string(r));
    EXPECT_EQ(rankFile.metadata.at("shardema.world_size"), "4");
    EXPECT_EQ(rankFile.tensors.size(), job.model.size()) << "every tensor, empty pieces too";
  }
}

TEST(ShardedCheckpointTest, ReshardFrom4ToOtherWorldSizesLoadsTheFullEma) {
  for (const shard::LayoutKind kind :
       {shard::LayoutKind::kFsdp2, shard::LayoutKind::kReplicated, shard::LayoutKind::kRankZero}) {
    testing::TempDir dir;
    PerTensorJob job(testing::unevenModel(at::kBFloat16, true), kind, 4);
    job.run(1, 9);
    saveCheckpoint(dir.file("w4"), job.averagers());
    for (const int64_t w : {1, 2, 3, 5}) {
      const std::string out = dir.file("w" + std::to_string(w));
      ExportOptions small;
      small.bufferBytes = 12;  // many pieces per range
      reshardCheckpoint(dir.file("w4"), out, w, small);
      const RankManifest manifest = inspectCheckpoint(out);
      EXPECT_EQ(manifest.worldSize(), w);
      EXPECT_EQ(manifest.step, 9);
      const shard::LayoutKind targetKind = manifest.layout.specs.front().kind;
      const auto loaded = loadInto(job.model, targetKind, w, out);
      testing::expectEqualsReference(
          job.reference, loaded[0].averager->layout(),
          testing::unionOfRanks(testing::averagersOf(loaded)),
          std::string(shard::layoutKindName(kind)) + " 4 -> " + std::to_string(w));
      EXPECT_EQ(loaded.back().averager->step(), 9);
    }
  }
}

// At world size 1 every layout holds every element on the one rank: a
// checkpoint of any layout resharded to 1 rank (`shardema export
// --world-size 1`, what the refusal of a W = 1 load advises) loads into a
// single process's EMA (replicated over 1 rank) and into every other layout
// of one rank. Replicated and FSDP2 split alike at any world size. Once
// refused as "laid out as fsdp2 in the checkpoint but replicated here".
TEST(ShardedCheckpointTest, AnyLayoutLoadsWhereEveryRankHoldsTheSameElements) {
  const std::vector<shard::LayoutKind> kinds = {
      shard::LayoutKind::kFsdp2, shard::LayoutKind::kReplicated, shard::LayoutKind::kRankZero};
  for (const shard::LayoutKind saved : kinds) {
    testing::TempDir dir;
    PerTensorJob job(testing::unevenModel(at::kBFloat16, true), saved, 3);
    job.run(1, 5);
    saveCheckpoint(dir.file("w3"), job.averagers());
    reshardCheckpoint(dir.file("w3"), dir.file("w1"), 1);
    for (const shard::LayoutKind here : kinds) {
      const std::string what =
          std::string(shard::layoutKindName(saved)) + " 3 -> 1 into " + shard::layoutKindName(here);
      const auto loaded = loadInto(job.model, here, 1, dir.file("w1"));
      testing::expectEqualsReference(job.reference, loaded[0].averager->layout(),
                                     testing::unionOfRanks(testing::averagersOf(loaded)), what);
      EXPECT_EQ(loaded[0].averager->step(), 5) << what;
    }
  }
  testing::TempDir dir;
  PerTensorJob job(testing::unevenModel(at::kFloat, true), shard::LayoutKind::kFsdp2, 3);
  job.run(1, 4);
  saveCheckpoint(dir.path(), job.averagers());
  const auto replicated = loadInto(job.model, shard::LayoutKind::kReplicated, 3, dir.path());
  testing::expectEqualsReference(job.reference, replicated[0].averager->layout(),
                                 testing::unionOfRanks(testing::averagersOf(replicated)),
                                 "fsdp2 into replicated over 3 ranks");
}

void expectExportedEqualsReference(const std::string& file, const PerTensorJob& job,
                                   at::ScalarType dtype) {
  const TensorFile exported = readTensorFile(file);
  ASSERT_EQ(exported.tensors.size(), job.model.size());
  for (size_t i = 0; i < job.model.size(); ++i) {
    const auto& [name, tensor] = exported.tensors[i];
    EXPECT_EQ(name, job.model[i].name) << "layout order";
    const at::Tensor& ema = job.reference.ema(name);
    EXPECT_EQ(tensor.sizes(), ema.sizes()) << name;
    const at::Tensor want = at::isFloatingType(ema.scalar_type()) ? ema.to(dtype) : ema;
    EXPECT_TRUE(testing::sameTensor(tensor, want)) << name << " as " << dtype;
  }
  EXPECT_EQ(exported.metadata.at("shardema.kind"), "deployable_weights");
  EXPECT_EQ(exported.metadata.at("shardema.step"), std::to_string(job.reference.step()));
  EXPECT_EQ(exported.metadata.at("shardema.schedule"), job.reference.schedule().toJson());
}

TEST(ShardedCheckpointTest, ExportMergesRankFilesIntoFullTensorsInEachDtype) {
  testing::TempDir dir;
  PerTensorJob job(testing::unevenModel(at::kBFloat16, true), shard::LayoutKind::kFsdp2, 3);
  job.run(1, 6);
  saveCheckpoint(dir.file("ckpt"), job.averagers());
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    ExportOptions options;
    options.outputDtype = dtype;
    options.bufferBytes = 20;
    const ExportSummary summary = exportCheckpoint(dir.file("ckpt"), dir.file("out"), options);
    EXPECT_EQ(summary.step, 6);
    EXPECT_EQ(summary.tensors, static_cast<int64_t>(job.model.size()));
    EXPECT_EQ(summary.bytes, fs::file_size(dir.file("out")));
    expectExportedEqualsReference(dir.file("out"), job, dtype);
  }
  ExportOptions bad;
  bad.outputDtype = at::kDouble;
  EXPECT_THROW(exportCheckpoint(dir.file("ckpt"), dir.file("out"), bad), c10::ValueError);
}

// numpy (the venv's Python) reads the exported file and finds the values of a
// reference file holding the single-process EMA.
TEST(ShardedCheckpointTest, NumpyReadsTheExportedFileAsTheFullEma) {
  const std::string python = SHARDEMA_TEST_PYTHON;
  testing::TempDir dir;
  PerTensorJob job(testing::unevenModel(at::kFloat, false), shard::LayoutKind::kFsdp2, 4);
  job.run(1, 5);
  saveCheckpoint(dir.file("ckpt"), job.averagers());
  exportCheckpoint(dir.file("ckpt"), dir.file("export.safetensors"));
  TensorFile reference;
  for (const auto& [name, ema] : job.reference.emaTensors())
    reference.tensors.emplace_back(name, ema);
  writeTensorFile(dir.file("reference.safetensors"), reference);
  const std::string script = R"(import json, struct, sys
import numpy as np
def load(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    out = {}
    for name, e in header.items():
        assert e["dtype"] == "F32", (name, e["dtype"])
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(data[b:end], dtype="<f4").reshape(e["shape"])
    return out, meta
got, meta = load(sys.argv[1])
want, _ = load(sys.argv[2])
assert meta["shardema.kind"] == "deployable_weights", meta
assert meta["shardema.step"] == "5", meta
assert sorted(got) == sorted(want), (sorted(got), sorted(want))
for name in want:
    assert got[name].shape == want[name].shape, name
    assert np.array_equal(got[name].view(np.uint32), want[name].view(np.uint32)), name
print("ok", len(want))
)";
  std::ofstream(dir.file("check.py")) << script;
  const std::string out = testing::runCommand("'" + python + "' '" + dir.file("check.py") + "' '" +
                                              dir.file("export.safetensors") + "' '" +
                                              dir.file("reference.safetensors") + "' 2>&1")
                              .output;
  EXPECT_EQ(out, "ok " + std::to_string(job.model.size()) + "\n");
}

}  // namespace
}  // namespace shardema
