// `shardema synthesize` against the reference post-hoc run: the lucid_fp32
// snapshots of tests/data/posthoc_ema_run.json are written by hand in the
// documented snapshot format (DESIGN.md section 5), once as a rank-0 full-copy
// folder and once split over two ranks; the CLI's output must match the
// references' synthesized weights and be the same for both post-hoc layouts.
// The same folders through `inspect` and `export`, which name them for what
// they are.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/core/checksum.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "support/file_bytes.h"
#include "support/temp_dir.h"
#include "tools/checkpoint_cli_fixture.h"

namespace shardema {
namespace {

using nlohmann::json;
using testing::runCli;

constexpr double kGoldenTolerance = 1e-6;
const double kSigmaRels[2] = {0.05, 0.1};

std::string decimal17(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

const json& lucidRun() {
  static const json run = [] {
    std::ifstream in(std::string(SHARDEMA_TEST_DATA_DIR) + "/posthoc_ema_run.json");
    EXPECT_TRUE(in.good());
    return json::parse(in).at("runs").at(0);
  }();
  return run;
}

// "theta" = the golden snapshot's 4 values, "count" an int64 copy that
// records the step (so the copy's source snapshot is visible).
struct Snapshot {
  int index;
  int64_t step;
  std::vector<float> theta;
};

std::vector<Snapshot> goldenSnapshots() {
  std::vector<Snapshot> out;
  for (const auto& s : lucidRun().at("snapshots")) {
    const std::string file = s.at("file");
    const size_t dot = file.find('.');
    out.push_back({std::stoi(file.substr(0, dot)), std::stoll(file.substr(dot + 1)),
                   s.at("contents").at("ema_model.theta").at("values").get<std::vector<float>>()});
  }
  return out;
}

std::map<std::string, std::string> metadataOf(const Snapshot& s) {
  const double gamma = sigmaRelToGamma(kSigmaRels[s.index]);
  return {{"shardema.kind", "posthoc_snapshot"},
          {"shardema.sigma_rel", decimal17(gammaToSigmaRel(gamma))},
          {"shardema.gamma", decimal17(gamma)},
          {"shardema.step", std::to_string(s.step)},
          {"shardema.profile_index", std::to_string(s.index)}};
}

std::string fileName(const Snapshot& s) {
  return std::to_string(s.index) + "." + std::to_string(s.step) + ".safetensors";
}

void writeFullFolder(const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (const Snapshot& s : goldenSnapshots()) {
    TensorFile file;
    file.tensors = {{"theta", at::tensor(s.theta)}, {"count", at::full({2}, s.step, at::kLong)}};
    file.metadata = metadataOf(s);
    writeTensorFile(dir + "/" + fileName(s), file);
  }
}

// FSDP2 over 2 ranks: theta [4] rows 0-1 | 2-3, count [2] rows 0 | 1.
std::string layoutJson() {
  return R"({"format":1,"world_size":2,"tensors":[)"
         R"({"name":"theta","kind":"fsdp2","dtype":"F32","shape":[4],"ranges":[[0,2],[2,4]]},)"
         R"({"name":"count","kind":"fsdp2","dtype":"I64","shape":[2],"ranges":[[0,1],[1,2]]}]})";
}

void writeShardedFolder(const std::string& dir, const std::string& layout = layoutJson()) {
  for (int rank = 0; rank < 2; ++rank) {
    const std::string rankDir = dir + "/rank_0000" + std::to_string(rank);
    std::filesystem::create_directories(rankDir);
    for (const Snapshot& s : goldenSnapshots()) {
      TensorFile file;
      const at::Tensor theta = at::tensor(s.theta);
      file.tensors = {{"theta", theta.slice(0, 2 * rank, 2 * rank + 2).contiguous()},
                      {"count", at::full({1}, s.step, at::kLong)}};
      file.metadata = metadataOf(s);
      file.metadata["shardema.rank"] = std::to_string(rank);
      file.metadata["shardema.world_size"] = "2";
      file.metadata["shardema.layout"] = layout;
      writeTensorFile(rankDir + "/" + fileName(s), file);
    }
  }
}

class SynthesizeCommandTest : public ::testing::Test {
 protected:
  testing::TempDir temp_;
  std::string path(const std::string& name) const { return temp_.path() + "/" + name; }
};

TEST_F(SynthesizeCommandTest, FullFolderMatchesTheReferenceSynthesis) {
  writeFullFolder(path("full"));
  for (const auto& item : lucidRun().at("synthesized").items()) {
    const json& target = item.value();
    const std::string out = path("out.safetensors");
    const testing::CliResult result =
        runCli("synthesize --snapshots " + path("full") + " --sigma-rel " +
               decimal17(target.at("target_sigma_rel").get<double>()) + " --step " +
               std::to_string(target.at("target_step").get<int64_t>()) + " --out " + out);
    ASSERT_EQ(result.status, 0) << result.err;
    // One weight line per snapshot, then the sum and the summary.
    EXPECT_EQ(testing::countLines(result.out), 1 + 20 + 2) << result.out;
    const TensorFile file = readTensorFile(out);
    const at::Tensor theta = file.at("theta");
    ASSERT_EQ(theta.scalar_type(), at::kFloat);
    const auto expected = target.at("synthesized_theta").get<std::vector<double>>();
    for (size_t e = 0; e < expected.size(); ++e) {
      EXPECT_NEAR(theta[e].item<float>(), expected[e], kGoldenTolerance) << item.key();
    }
    // The copy comes from the newest snapshot at or before the target.
    EXPECT_EQ(file.at("count")[0].item<int64_t>(), target.at("target_step").get<int64_t>());
    EXPECT_EQ(file.metadata.at("shardema.kind"), "deployable_weights");
    EXPECT_EQ(file.metadata.at("shardema.step"),
              std::to_string(target.at("target_step").get<int64_t>()));
  }
}

TEST_F(SynthesizeCommandTest, ShardedFolderMergesToTheSameWeights) {
  writeFullFolder(path("full"));
  writeShardedFolder(path("sharded"));
  for (const char* flags :
       {"--sigma-rel 0.08", "--sigma-rel 0.15 --normalize", "--sigma-rel 0.08 --step 50"}) {
    const testing::CliResult full = runCli("synthesize --snapshots " + path("full") + " " + flags +
                                           " --out " + path("a.safetensors"));
    const testing::CliResult sharded = runCli("synthesize --snapshots " + path("sharded") + " " +
                                              flags + " --out " + path("b.safetensors"));
    ASSERT_EQ(full.status, 0) << full.err;
    ASSERT_EQ(sharded.status, 0) << sharded.err;
    EXPECT_NE(sharded.out.find("merged from 2 ranks"), std::string::npos) << sharded.out;
    const TensorFile a = readTensorFile(path("a.safetensors"));
    const TensorFile b = readTensorFile(path("b.safetensors"));
    // Same float64 sums element by element: identical bits.
    EXPECT_TRUE(at::equal(a.at("theta"), b.at("theta"))) << flags;
    EXPECT_TRUE(at::equal(a.at("count"), b.at("count"))) << flags;
    EXPECT_EQ(b.at("theta").sizes(), at::IntArrayRef({4}));
  }
}

TEST_F(SynthesizeCommandTest, NormalizeAndDtypeFlags) {
  writeFullFolder(path("full"));
  const testing::CliResult raw = runCli("synthesize --snapshots " + path("full") +
                                        " --sigma-rel 0.15 --out " + path("raw.safetensors"));
  const testing::CliResult norm =
      runCli("synthesize --snapshots " + path("full") +
             " --sigma-rel 0.15 --normalize --dtype bf16 --out " + path("norm.safetensors"));
  ASSERT_EQ(raw.status, 0) << raw.err;
  ASSERT_EQ(norm.status, 0) << norm.err;
  // The golden raw sum of weights for sigma_rel 0.15 at step 100.
  EXPECT_NE(raw.out.find("sum of weights 0.997471"), std::string::npos) << raw.out;
  EXPECT_NE(norm.out.find("sum of weights 1.000000"), std::string::npos) << norm.out;
  const TensorFile rawFile = readTensorFile(path("raw.safetensors"));
  const TensorFile normFile = readTensorFile(path("norm.safetensors"));
  EXPECT_EQ(normFile.at("theta").scalar_type(), at::kBFloat16);
  EXPECT_EQ(normFile.metadata.at("shardema.synthesis"), "normalized");
  const at::Tensor expected = (rawFile.at("theta").to(at::kDouble) / 0.9974714108690335);
  EXPECT_TRUE(at::allclose(normFile.at("theta").to(at::kDouble), expected, 1e-2, 0.0));
}

TEST_F(SynthesizeCommandTest, BadInputIsOneLineAndExitTwo) {
  writeFullFolder(path("full"));
  const std::string out = " --out " + path("x.safetensors");
  struct Case {
    std::string args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"--sigma-rel 0.1" + out, "--snapshots"},
      {"--snapshots " + path("full") + out, "--sigma-rel"},
      {"--snapshots " + path("full") + " --sigma-rel 0.1", "--out"},
      {"--snapshots " + path("full") + " --sigma-rel 0.3" + out, "--sigma-rel"},
      {"--snapshots " + path("full") + " --sigma-rel abc" + out, "sigma-rel"},
      {"--snapshots " + path("full") + " --sigma-rel 0.1 --step 101" + out, "beyond the newest"},
      {"--snapshots " + path("full") + " --sigma-rel 0.1 --step 5" + out, "at least two"},
      {"--snapshots " + path("full") + " --sigma-rel 0.1 --dtype f64" + out, "--dtype"},
      {"--snapshots " + path("missing") + " --sigma-rel 0.1" + out, "missing"},
      {"--snapshots " + path("full") + " --sigma-rel 0.1 --bogus 1" + out, "bogus"},
  };
  for (const Case& c : cases) {
    const testing::CliResult result = runCli("synthesize " + c.args);
    EXPECT_EQ(result.status, 2) << c.args << "\n" << result.err;
    EXPECT_EQ(testing::countLines(result.err), 1u) << c.args << "\n" << result.err;
    EXPECT_NE(result.err.find(c.says), std::string::npos) << c.args << "\n" << result.err;
  }
  EXPECT_FALSE(std::filesystem::exists(path("x.safetensors")));
}

TEST_F(SynthesizeCommandTest, MismatchedFoldersAreRefused) {
  // A snapshot whose metadata disagrees with its name.
  writeFullFolder(path("renamed"));
  std::filesystem::rename(path("renamed/0.10.safetensors"), path("renamed/0.15.safetensors"));
  testing::CliResult result = runCli("synthesize --snapshots " + path("renamed") +
                                     " --sigma-rel 0.1 --out " + path("y.safetensors"));
  EXPECT_EQ(result.status, 2);
  EXPECT_NE(result.err.find("0.15.safetensors"), std::string::npos) << result.err;
  // Mixed layouts: both top-level snapshots and rank folders.
  writeFullFolder(path("mixed"));
  writeShardedFolder(path("mixed"));
  result = runCli("synthesize --snapshots " + path("mixed") + " --sigma-rel 0.1 --out " +
                  path("y.safetensors"));
  EXPECT_EQ(result.status, 2);
  EXPECT_NE(result.err.find("mixed"), std::string::npos) << result.err;
  // Ranks whose files record different layouts.
  writeShardedFolder(path("twolayouts"));
  std::string other = layoutJson();
  other.replace(other.find("[[0,2],[2,4]]"), 13, "[[0,3],[3,4]]");
  TensorFile file = readTensorFile(path("twolayouts/rank_00001/0.100.safetensors"));
  file.metadata["shardema.layout"] = other;
  writeTensorFile(path("twolayouts/rank_00001/0.100.safetensors"), file);
  result = runCli("synthesize --snapshots " + path("twolayouts") + " --sigma-rel 0.1 --out " +
                  path("y.safetensors"));
  EXPECT_EQ(result.status, 2);
  EXPECT_NE(result.err.find("layout"), std::string::npos) << result.err;
  EXPECT_FALSE(std::filesystem::exists(path("y.safetensors")));
}

// inspect names a post-hoc folder for what it is (not "manifest.json
// missing"): its layout, profiles and steps as the files say, every file.
TEST_F(SynthesizeCommandTest, InspectListsAPostHocFolder) {
  writeFullFolder(path("full"));
  const testing::CliResult result = runCli("inspect " + path("full"));
  ASSERT_EQ(result.status, 0) << result.err;
  std::map<int, std::vector<int64_t>> steps;
  for (const Snapshot& s : goldenSnapshots()) steps[s.index].push_back(s.step);
  for (auto& [index, list] : steps) std::sort(list.begin(), list.end());
  const size_t count = goldenSnapshots().size();
  EXPECT_EQ(result.out.rfind("post-hoc snapshot folder " + path("full") + " (rank-0 full copy, " +
                                 std::to_string(count) + " snapshots of sigma_rel " +
                                 decimal17(gammaToSigmaRel(sigmaRelToGamma(kSigmaRels[0]))),
                             0),
            0u)
      << result.out;
  for (const auto& [index, list] : steps) {
    std::string line = "\n  profile " + std::to_string(index) + " sigma_rel ";
    EXPECT_NE(result.out.find(line), std::string::npos) << result.out;
    std::string tail = " steps";
    for (const int64_t step : list) tail += " " + std::to_string(step);
    EXPECT_NE(result.out.find(tail + "\n"), std::string::npos) << tail << "\n" << result.out;
  }
  for (const Snapshot& s : goldenSnapshots()) {
    const std::string file = path("full/" + fileName(s));
    EXPECT_NE(result.out.find("  snapshot " + file + " 2 tensors, "), std::string::npos) << file;
    EXPECT_NE(result.out.find("xxh64 " + checksumHex(fileChecksum(file)) + " ok"),
              std::string::npos);
  }
  EXPECT_NE(result.out.find("\n  tensor theta F32 [4]\n  tensor count I64 [2]\n"),
            std::string::npos)
      << result.out;
}

TEST_F(SynthesizeCommandTest, InspectListsAShardedPostHocFolderWithGlobalShapes) {
  writeShardedFolder(path("sharded"));
  const testing::CliResult result = runCli("inspect " + path("sharded"));
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(result.out.rfind("post-hoc snapshot folder " + path("sharded") + " (sharded over 2 ranks, ", 0), 0u)
      << result.out;
  EXPECT_NE(result.out.find("  snapshot " + path("sharded/rank_00001/0.100.safetensors")),
            std::string::npos);
  EXPECT_NE(result.out.find("\n  tensor theta Float [4]\n  tensor count Long [2]\n"),
            std::string::npos)
      << result.out;
}

// What synthesis would refuse, inspect refuses first, naming the file; and
// export says what the folder is and what writes its weights.
TEST_F(SynthesizeCommandTest, InspectAndExportOfAPostHocFolderRefuseInOneLine) {
  writeFullFolder(path("full"));
  const std::vector<Snapshot> snapshots = goldenSnapshots();
  const std::string newest = path("full/" + fileName(snapshots.back()));
  TensorFile file = readTensorFile(newest);
  file.tensors[0].second = at::zeros({5});
  writeTensorFile(newest, file);
  testing::CliResult result = runCli("inspect " + path("full"));
  EXPECT_EQ(result.status, 2) << result.out;
  EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
  EXPECT_NE(result.err.find(newest + ": tensor 'theta' F32 [5] differs from "), std::string::npos)
      << result.err;
  result = runCli("export --checkpoint " + path("full") + " --out " + path("x.safetensors"));
  EXPECT_EQ(result.status, 2);
  EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
  EXPECT_NE(result.err.find("--checkpoint post-hoc snapshot folder " + path("full") + " ("),
            std::string::npos)
      << result.err;
  EXPECT_NE(result.err.find("shardema synthesize --snapshots " + path("full")), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(path("x.safetensors")));
}

// A DCP folder's format is torch's (a pickle): the C++ binary names it and
// what reads it, instead of "manifest.json missing".
TEST_F(SynthesizeCommandTest, ADcpFolderIsNamedForWhatItIs) {
  std::filesystem::create_directories(path("dcp"));
  testing::writeFileBytes(path("dcp/.metadata"), "pickle");
  testing::writeFileBytes(path("dcp/__0_0.distcp"), "data");
  for (const std::string& args :
       {"inspect " + path("dcp"), "export --checkpoint " + path("dcp") + " --out " + path("x")}) {
    const testing::CliResult result = runCli(args);
    EXPECT_EQ(result.status, 2) << args;
    EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
    EXPECT_NE(result.err.find(path("dcp") + ": a torch.distributed.checkpoint (DCP) folder"),
              std::string::npos)
        << result.err;
    EXPECT_NE(result.err.find("pip install ."), std::string::npos) << result.err;
  }
}

}  // namespace
}  // namespace shardema
