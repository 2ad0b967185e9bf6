// A Python training job writes post-hoc snapshots itself: the venv's Python
// with numpy (no shardema code, no safetensors, no torch) writes the lucid_fp32
// snapshots of tests/data/posthoc_ema_run.json in the documented format
// (tests/python/write_posthoc_snapshots.py), and `shardema synthesize` must
// turn them into the reference's synthesized weights.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "support/command_output.h"
#include "support/temp_dir.h"
#include "tools/checkpoint_cli_fixture.h"

namespace shardema {
namespace {

using nlohmann::json;
using testing::runCli;

constexpr double kGoldenTolerance = 1e-6;

std::string goldenPath() { return std::string(SHARDEMA_TEST_DATA_DIR) + "/posthoc_ema_run.json"; }

const json& lucidRun() {
  static const json run = [] {
    std::ifstream in(goldenPath());
    EXPECT_TRUE(in.good());
    return json::parse(in).at("runs").at(0);
  }();
  return run;
}

std::string decimal17(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

// write_posthoc_snapshots.py GOLDEN_JSON DIR [extra]; stdout and stderr.
testing::CommandResult writeSnapshots(const std::string& dir, const std::string& extra = "") {
  return testing::runCommand(std::string("'") + SHARDEMA_TEST_PYTHON + "' '" +
                             SHARDEMA_TEST_SOURCE_DIR + "/python/write_posthoc_snapshots.py' '" +
                             goldenPath() + "' '" + dir + "' " + extra + " 2>&1");
}

class PythonSnapshotsTest : public ::testing::Test {
 protected:
  testing::TempDir temp_;
  std::string path(const std::string& name) const { return temp_.path() + "/" + name; }
};

TEST_F(PythonSnapshotsTest, PythonWrittenSnapshotsSynthesizeToTheGoldenWeights) {
  const testing::CommandResult wrote = writeSnapshots(path("snapshots"));
  ASSERT_EQ(wrote.exitCode, 0) << wrote.output;

  // Every golden snapshot is there, and shardema reads its metadata as the
  // profile it came from (gamma as C++ computes it from sigma_rel).
  const SnapshotFolder folder = scanSnapshotFolder(path("snapshots"));
  ASSERT_FALSE(folder.sharded);
  ASSERT_EQ(folder.snapshots.size(), lucidRun().at("snapshots").size());
  for (const SnapshotEntry& entry : folder.snapshots) {
    const double sigmaRel = entry.info.profileIndex == 0 ? 0.05 : 0.1;
    EXPECT_EQ(entry.info.sigmaRel, sigmaRel) << entry.path;
    EXPECT_NEAR(entry.info.gamma, sigmaRelToGamma(sigmaRel), 1e-12 * entry.info.gamma)
        << entry.path;
    const TensorFile file = readTensorFile(entry.path);
    EXPECT_EQ(file.metadata.at("shardema.format"), "1") << entry.path;
    EXPECT_EQ(file.at("theta").scalar_type(), at::kFloat) << entry.path;
  }

  for (const auto& item : lucidRun().at("synthesized").items()) {
    SCOPED_TRACE(item.key());
    const json& target = item.value();
    const std::string out = path("out.safetensors");
    const testing::CliResult result =
        runCli("synthesize --snapshots " + path("snapshots") + " --sigma-rel " +
               decimal17(target.at("target_sigma_rel").get<double>()) + " --step " +
               std::to_string(target.at("target_step").get<int64_t>()) + " --out " + out);
    ASSERT_EQ(result.status, 0) << result.err;
    const TensorFile file = readTensorFile(out);
    const at::Tensor theta = file.at("theta");
    ASSERT_EQ(theta.scalar_type(), at::kFloat);
    const auto expected = target.at("synthesized_theta").get<std::vector<double>>();
    ASSERT_EQ(theta.numel(), static_cast<int64_t>(expected.size()));
    for (size_t e = 0; e < expected.size(); ++e) {
      EXPECT_NEAR(theta[e].item<float>(), expected[e], kGoldenTolerance) << "element " << e;
    }
    EXPECT_EQ(file.metadata.at("shardema.kind"), "deployable_weights");
    EXPECT_EQ(file.metadata.at("shardema.step"),
              std::to_string(target.at("target_step").get<int64_t>()));
  }
}

// The control: shardema checks what Python wrote rather than trusting it; a
// gamma that disagrees with its sigma_rel is refused, naming the file.
TEST_F(PythonSnapshotsTest, PythonSnapshotWithWrongGammaIsRefused) {
  const testing::CommandResult wrote = writeSnapshots(path("snapshots"), "--corrupt-gamma");
  ASSERT_EQ(wrote.exitCode, 0) << wrote.output;
  const testing::CliResult result = runCli("synthesize --snapshots " + path("snapshots") +
                                           " --sigma-rel 0.08 --out " + path("x.safetensors"));
  EXPECT_EQ(result.status, 2) << result.err;
  EXPECT_EQ(testing::countLines(result.err), 1u) << result.err;
  EXPECT_NE(result.err.find("1.50.safetensors"), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("disagrees"), std::string::npos) << result.err;
  EXPECT_FALSE(std::filesystem::exists(path("x.safetensors")));
}

}  // namespace
}  // namespace shardema
