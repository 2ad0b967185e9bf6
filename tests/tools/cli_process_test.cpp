// The `shardema` binary against cli::runCommandLine, which the other CLI
// tests call in-process: main() adds only the exit status and the real
// streams, so each case must give the same status, stdout and stderr both
// ways (and errors stay one line on the real stderr).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "support/temp_dir.h"
#include "tools/cli_run.h"

namespace shardema {
namespace {

using testing::CliResult;
using testing::runCli;
using testing::runCliProcess;

void expectSameBothWays(const std::string& args, int status) {
  const CliResult inProcess = runCli(args);
  const CliResult process = runCliProcess(args);
  EXPECT_EQ(process.status, status) << args << ": " << process.err;
  EXPECT_EQ(process.status, inProcess.status) << args;
  EXPECT_EQ(process.out, inProcess.out) << args;
  EXPECT_EQ(process.err, inProcess.err) << args;
  if (status != 0) {
    EXPECT_EQ(std::count(process.err.begin(), process.err.end(), '\n'), 1) << args << ": " << process.err;
  }
}

TEST(CliProcessTest, TheBinaryGivesWhatTheInProcessRunGives) {
  expectSameBothWays("--help", 0);
  expectSameBothWays("schedule --kind constant --decay 0.5 --steps 1-3", 0);
  expectSameBothWays("schedule --kind warmup --steps x", 2);  // a UsageError
  expectSameBothWays("scheduel", 2);                          // no such command
  expectSameBothWays("--version", 0);
  testing::TempDir dir;
  expectSameBothWays("inspect " + dir.file("missing.safetensors"), 2);  // a c10::ValueError
}

// The project's version (CMakeLists.txt's project()), which the wheel and
// shardema.__version__ carry too (tests/python/test_cli_package.py).
TEST(CliProcessTest, VersionPrintsTheProjectVersion) {
  const CliResult result = runCli("--version");
  EXPECT_EQ(result.status, 0);
  EXPECT_EQ(result.out, std::string("shardema ") + SHARDEMA_PROJECT_VERSION + "\n");
  EXPECT_TRUE(result.err.empty()) << result.err;
}

TEST(CliProcessTest, NoArgumentsPrintUsageOnStderrWithStatus2) {
  const CliResult process = runCliProcess("");
  EXPECT_EQ(process.status, 2);
  EXPECT_TRUE(process.out.empty()) << process.out;
  EXPECT_EQ(process.err.rfind("usage: shardema", 0), 0u) << process.err;
}

}  // namespace
}  // namespace shardema
