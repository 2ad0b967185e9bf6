// `shardema export` on a checkpoint written by hand from the format
// contract: merged values, resharding, and one-line errors with status 2.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/core/tensor_file.h"
#include "support/file_bytes.h"
#include "support/same_bytes.h"
#include "support/temp_dir.h"
#include "tools/checkpoint_cli_fixture.h"

namespace shardema {
namespace {

using testing::HandCheckpoint;
using testing::runCli;

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         testing::sameBytes(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes());
}

TEST(ExportCommandTest, MergesRankFilesIntoFullTensors) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  for (const auto& [flag, dtype] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"", at::kFloat}, {" --dtype bf16", at::kBFloat16}, {" --dtype f16", at::kHalf}}) {
    const auto result =
        runCli("export --checkpoint " + dir.file("ckpt") + " --out " + dir.file("out") + flag);
    ASSERT_EQ(result.status, 0) << result.err;
    EXPECT_NE(result.out.find("2 tensors, step 42"), std::string::npos) << result.out;
    const TensorFile file = readTensorFile(dir.file("out"));
    ASSERT_EQ(file.tensors.size(), 2u);
    EXPECT_EQ(file.tensors[0].first, "w");
    EXPECT_TRUE(same(file.tensors[0].second, HandCheckpoint::fullW().to(dtype))) << flag;
    EXPECT_TRUE(same(file.tensors[1].second, HandCheckpoint::fullB().to(dtype))) << flag;
    EXPECT_EQ(file.metadata.at("shardema.kind"), "deployable_weights");
    EXPECT_EQ(file.metadata.at("shardema.step"), "42");
  }
}

// --max-shard-size: Hugging Face's layout (tests/python/test_hf_export.py
// loads it with transformers and huggingface_hub): w (24 bytes) fills the
// first file, b (12) the second; everything in one model.safetensors when
// it fits.
TEST(ExportCommandTest, MaxShardSizeWritesAFolderWithAnIndex) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  const std::string folder = dir.file("hf");
  auto result = runCli("export --checkpoint " + dir.file("ckpt") + " --out " + folder +
                       " --max-shard-size 24");
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_NE(result.out.find("2 tensors, step 42, f32"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find(" in 2 files"), std::string::npos) << result.out;
  const auto index = nlohmann::json::parse(
      testing::readFileBytes(folder + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 36);
  EXPECT_EQ(index["weight_map"], (nlohmann::json{{"w", "model-00001-of-00002.safetensors"},
                                                 {"b", "model-00002-of-00002.safetensors"}}));
  const TensorFile first = readTensorFile(folder + "/model-00001-of-00002.safetensors");
  const TensorFile second = readTensorFile(folder + "/model-00002-of-00002.safetensors");
  EXPECT_TRUE(same(first.at("w"), HandCheckpoint::fullW()));
  EXPECT_TRUE(same(second.at("b"), HandCheckpoint::fullB()));
  for (const TensorFile* file : {&first, &second}) {
    EXPECT_EQ(file->metadata.at("format"), "pt");  // transformers' loader needs it
    EXPECT_EQ(file->metadata.at("shardema.step"), "42");
  }
  // bf16, and one file when all fit: the index and the split files go.
  result = runCli("export --checkpoint " + dir.file("ckpt") + " --out " + folder +
                  " --max-shard-size 1GB --dtype bf16");
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_NE(result.out.find(" in 1 files"), std::string::npos) << result.out;
  EXPECT_FALSE(std::filesystem::exists(folder + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(folder + "/model-00001-of-00002.safetensors"));
  const TensorFile one = readTensorFile(folder + "/model.safetensors");
  EXPECT_TRUE(same(one.at("w"), HandCheckpoint::fullW().to(at::kBFloat16)));
  EXPECT_EQ(one.metadata.at("format"), "pt");
}

TEST(ExportCommandTest, WorldSizeWritesAReshardedCheckpoint) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  for (const int w : {1, 3, 5}) {
    const std::string out = dir.file("w" + std::to_string(w));
    auto result = runCli("export --checkpoint " + dir.file("ckpt") + " --world-size " +
                         std::to_string(w) + " --out " + out);
    ASSERT_EQ(result.status, 0) << result.err;
    EXPECT_TRUE(std::filesystem::exists(out + "/manifest.json"));
    // FSDP2 rows of w over W ranks: rank 0 of W=3 holds row 0 only.
    const TensorFile rank0 = readTensorFile(testing::rankFileIn(out, 0));
    EXPECT_EQ(rank0.tensors[0].second.numel(), w == 1 ? 6 : 2) << w;
    result = runCli("export --checkpoint " + out + " --out " + out + ".safetensors");
    ASSERT_EQ(result.status, 0) << result.err;
    const TensorFile merged = readTensorFile(out + ".safetensors");
    EXPECT_TRUE(same(merged.tensors[0].second, HandCheckpoint::fullW())) << w;
    EXPECT_TRUE(same(merged.tensors[1].second, HandCheckpoint::fullB())) << w;
  }
}

TEST(ExportCommandTest, LayoutWritesACheckpointForExactlyThatLayoutFsdp1Included) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  // An FSDP1 job on 3 ranks: one flat parameter [w | b] of 9 elements, 3 per
  // rank, so w is [0,3) [3,6) [6,6) and b [0,0) [0,0) [0,3).
  const std::string layout =
      R"({"format":1,"world_size":3,"tensors":[)"
      R"({"name":"w","kind":"fsdp1","dtype":"F32","shape":[3,2],"ranges":[[0,3],[3,6],[6,6]]},)"
      R"({"name":"b","kind":"fsdp1","dtype":"F32","shape":[3],"ranges":[[0,0],[0,0],[0,3]]}]})";
  testing::writeFileBytes(dir.file("layout.json"), layout);
  const std::string out = dir.file("fsdp1");
  auto result = runCli("export --checkpoint " + dir.file("ckpt") + " --layout " +
                       dir.file("layout.json") + " --out " + out);
  ASSERT_EQ(result.status, 0) << result.err;
  const auto manifest = nlohmann::json::parse(testing::readFileBytes(out + "/manifest.json"));
  EXPECT_EQ(manifest["layout"], nlohmann::json::parse(layout));
  const TensorFile rank1 = readTensorFile(testing::rankFileIn(out, 1));
  EXPECT_TRUE(same(rank1.tensors[0].second, at::arange(3, 6, at::kFloat)));
  const TensorFile rank2 = readTensorFile(testing::rankFileIn(out, 2));
  EXPECT_TRUE(same(rank2.tensors[1].second, HandCheckpoint::fullB()));
  result = runCli("export --checkpoint " + out + " --out " + out + ".safetensors");
  ASSERT_EQ(result.status, 0) << result.err;
  const TensorFile merged = readTensorFile(out + ".safetensors");
  EXPECT_TRUE(same(merged.tensors[0].second, HandCheckpoint::fullW()));
  EXPECT_TRUE(same(merged.tensors[1].second, HandCheckpoint::fullB()));
  // A bad layout file is a one-line usage error naming it.
  testing::writeFileBytes(dir.file("bad.json"), "{");
  result = runCli("export --checkpoint " + dir.file("ckpt") + " --layout " + dir.file("bad.json") +
                  " --out " + dir.file("x"));
  EXPECT_EQ(result.status, 2);
  EXPECT_NE(result.err.find("bad.json"), std::string::npos) << result.err;
  EXPECT_NE(runCli("export --help").out.find("--layout FILE"), std::string::npos);
}

// The issue's reproduction: a data byte flipped in rank 1's "b" and the
// manifest re-signed. export once merged it into a deployable file under a
// fresh checksum; now every tensor's checksum is checked before anything
// is written, and the output (file, temp file or folder) never appears.
TEST(ExportCommandTest, AFlippedDataByteUnderAReSignedManifestWritesNothing) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  const std::string rank1 = testing::flipDataByteUnderAReSignedManifest(dir.file("ckpt"), 1, "b");
  const std::string ckpt = " --checkpoint " + dir.file("ckpt");
  for (const std::string& args :
       {"export" + ckpt + " --out " + dir.file("out.safetensors"),
        "export" + ckpt + " --out " + dir.file("out.safetensors") + " --dtype bf16",
        "export" + ckpt + " --world-size 1 --out " + dir.file("resharded")}) {
    SCOPED_TRACE(args);
    const auto result = runCli(args);
    EXPECT_EQ(result.status, 2) << result.out;
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
    EXPECT_NE(result.err.find(rank1 + ": tensor 'b' fails its checksum"), std::string::npos)
        << result.err;
    std::vector<std::string> left;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      left.push_back(entry.path().filename());
    }
    EXPECT_EQ(left, std::vector<std::string>{"ckpt"}) << "export wrote something";
  }
}

TEST(ExportCommandTest, ErrorsAreOneLineNamingTheFileWithStatus2) {
  testing::TempDir dir;
  HandCheckpoint::write(dir.file("ckpt"));
  const std::string out = dir.file("out.safetensors");
  ASSERT_EQ(runCli("export --checkpoint " + dir.file("ckpt") + " --out " + out).status, 0);
  const std::string before = testing::readFileBytes(out);
  auto expectError = [&](const std::string& args, const std::string& named) {
    const auto result = runCli(args);
    EXPECT_EQ(result.status, 2) << args << ": " << result.err;
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
    EXPECT_EQ(result.err.rfind("shardema export: ", 0), 0u) << result.err;
    EXPECT_NE(result.err.find(named), std::string::npos) << result.err;
    EXPECT_EQ(testing::readFileBytes(out), before) << "a failed export replaced the output";
  };
  const std::string base = "export --checkpoint " + dir.file("ckpt") + " --out " + out;
  expectError("export --out " + out, "--checkpoint");
  expectError(base + " --dtype f64", "--dtype");
  expectError(base + " --world-size 0", "--world-size");
  expectError(base + " --max-shard-size 0", "--max-shard-size must be a positive number");
  expectError(base + " --max-shard-size 5XB", "got '5XB'");
  expectError("export --checkpoint " + dir.file("ckpt") + " --out " + dir.file("hf") +
                  " --max-shard-size 1GB --world-size 2",
              "--max-shard-size does not apply to --world-size");
  // A file name given as the folder of a split export.
  expectError(base + " --max-shard-size 1GB", "names a .safetensors file; give a folder");
  EXPECT_FALSE(std::filesystem::exists(dir.file("hf")));
  // At most the largest tensor's element count (6 here), checked before
  // anything is written: 100000 once wrote rank files at about 3 a second.
  const std::string resharded = dir.file("resharded");
  for (const char* w : {"7", "100000"}) {
    expectError(
        "export --checkpoint " + dir.file("ckpt") + " --world-size " + w + " --out " + resharded,
        "--world-size must be at most 6");
    EXPECT_FALSE(std::filesystem::exists(resharded)) << "a refused reshard left its output";
  }
  ASSERT_EQ(runCli("export --checkpoint " + dir.file("ckpt") + " --world-size 6 --out " + resharded)
                .status,
            0);
  expectError("export --checkpoint " + dir.file("nothing") + " --out " + out,
              "no valid checkpoint at " + dir.file("nothing"));
  expectError("export --checkpoint " + dir.file("ckpt") + " --out /proc/nope/out.safetensors",
              "/proc/nope/out.safetensors");
  std::string bytes = testing::readFileBytes(dir.file("ckpt/" + HandCheckpoint::name(1)));
  bytes.back() ^= 0x10;
  testing::writeFileBytes(dir.file("ckpt/" + HandCheckpoint::name(1)), bytes);
  expectError(base, HandCheckpoint::name(1));
  testing::writeFileBytes(dir.file("ckpt/" + HandCheckpoint::name(1)), bytes.substr(0, 100));
  expectError(base + " --dtype bf16", HandCheckpoint::name(1));
}

// An export must never write over or into what it reads: --out naming the
// checkpoint's own manifest or rank file once "succeeded" and left the
// checkpoint unreadable. Refused with status 2, and the checkpoint still
// exports afterwards.
TEST(ExportCommandTest, RefusesAnOutputInsideTheCheckpointOrOverANonRegularFile) {
  testing::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  HandCheckpoint::write(ckpt);
  const std::string manifest = testing::readFileBytes(ckpt + "/manifest.json");
  auto expectRefused = [&](const std::string& out, const std::string& why) {
    const auto result = runCli("export --checkpoint " + ckpt + " --out " + out);
    EXPECT_EQ(result.status, 2) << out << ": " << result.err;
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
    EXPECT_NE(result.err.find(why), std::string::npos) << result.err;
    EXPECT_EQ(testing::readFileBytes(ckpt + "/manifest.json"), manifest);
  };
  expectRefused(ckpt + "/manifest.json", "lies inside the input " + ckpt);
  expectRefused(ckpt + "/" + HandCheckpoint::name(0), "lies inside the input");
  expectRefused(ckpt, "is the input " + ckpt + " itself");
  expectRefused(ckpt + "/../ckpt/manifest.json", "lies inside the input");
  expectRefused(ckpt + " --world-size 3", "is the input " + ckpt + " itself");
  std::filesystem::create_directories(dir.file("folder/inside"));
  expectRefused(dir.file("folder"), "exists and is a folder");
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  expectRefused(dir.file("fifo"), "exists and is a FIFO");
  EXPECT_TRUE(std::filesystem::is_fifo(dir.file("fifo")));
  ASSERT_EQ(runCli("export --checkpoint " + ckpt + " --out " + dir.file("ok")).status, 0);
  EXPECT_TRUE(same(readTensorFile(dir.file("ok")).at("w"), HandCheckpoint::fullW()));
}

// A FIFO or an oversized file in the manifest's place is refused at once
// (a FIFO used to hang every reader; a 300 MiB manifest was parsed).
TEST(ExportCommandTest, AManifestThatIsAFifoOrHugeIsRefusedAtOnce) {
  testing::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  HandCheckpoint::write(ckpt);
  std::filesystem::remove(ckpt + "/manifest.json");
  ASSERT_EQ(::mkfifo((ckpt + "/manifest.json").c_str(), 0600), 0);
  auto result = runCli("inspect " + ckpt);
  EXPECT_EQ(result.status, 2) << result.err;
  EXPECT_NE(result.err.find("manifest.json is not a regular file"), std::string::npos)
      << result.err;
  std::filesystem::remove(ckpt + "/manifest.json");
  testing::writeFileBytes(ckpt + "/manifest.json", std::string((64 << 20) + 1, ' '));
  result = runCli("export --checkpoint " + ckpt + " --out " + dir.file("out"));
  EXPECT_EQ(result.status, 2) << result.err;
  EXPECT_NE(result.err.find("the manifest is 67108865 bytes, more than the 67108864"),
            std::string::npos)
      << result.err;
}

}  // namespace
}  // namespace shardema
