// `shardema plan` in-process: each row against the model written out again
// here (node_plan.h's formulas, not the library's code), the rows in the
// order asked, and each bad flag named in one line with nothing printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "tools/cli_run.h"

namespace {

using shardema::testing::CliResult;
using shardema::testing::runCli;

std::vector<std::string> cellsOf(const std::string& line) {
  std::vector<std::string> cells;
  std::istringstream in(line);
  std::string cell;
  std::getline(in, cell, '|');  // before the first bar
  while (std::getline(in, cell, '|')) {
    const size_t first = cell.find_first_not_of(' ');
    const size_t last = cell.find_last_not_of(' ');
    if (first != std::string::npos) cells.push_back(cell.substr(first, last - first + 1));
  }
  return cells;
}

// The table's data rows, as cells.
std::vector<std::vector<std::string>> rowsOf(const std::string& out) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(out);
  std::string line;
  int tableLine = 0;
  while (std::getline(in, line)) {
    if (line.rfind("|", 0) != 0) continue;
    if (++tableLine > 2) rows.push_back(cellsOf(line));  // past the header and the rule
  }
  return rows;
}

double number(const std::string& cell) { return std::strtod(cell.c_str(), nullptr); }

// "875 M" -> 875e6.
double siNumber(const std::string& cell) {
  const double value = number(cell);
  const char unit = cell.back();
  const std::string units = "kMGTP";
  const size_t power = units.find(unit);
  return power == std::string::npos ? value : value * std::pow(1000.0, double(power + 1));
}

void expectNear3(double shown, double exact, const std::string& what) {
  // Printed with 3 significant digits.
  EXPECT_NEAR(shown, exact, std::fabs(exact) * 5e-3 + 1e-12) << what;
}

// 70e9 parameters on 64 ranks, bf16 sources, post-hoc's 2 profiles, a 2 s
// step, 30 GB/s links: every column recomputed from the model's definition.
TEST(PlanCommandTest, ARowIsTheModelOfItsInputs) {
  const CliResult result = runCli(
      "plan --parameters 70e9 --ranks 64 --source-bytes 2 --profiles 2 --step-seconds 2 "
      "--pcie-gbps 30 --update-every 1,4");
  ASSERT_EQ(result.status, 0) << result.err;
  const auto rows = rowsOf(result.out);
  ASSERT_EQ(rows.size(), 1u) << result.out;
  const auto& row = rows[0];
  ASSERT_EQ(row.size(), 14u) << result.out;
  const double perRank = std::ceil(70e9 / 64);
  const double perNode = 8 * perRank;
  EXPECT_EQ(row[0], "70e9");
  EXPECT_EQ(row[1], "64");
  expectNear3(siNumber(row[2]), perRank, "elements per rank");
  expectNear3(number(row[3]), perNode * 2 / 1e9, "PCIe GB");
  expectNear3(number(row[4]), perRank * 2 / 30e9 * 1e3, "PCIe ms");
  const double hostBytes = perNode * (2 * 2 + 8 * 2);
  expectNear3(number(row[5]), hostBytes / 1e9, "host memory GB");
  expectNear3(number(row[6]), hostBytes / 400e9 * 1e3, "host memory ms");
  const double ram = perNode * 8 + 8.0 * (32 << 20);
  expectNear3(number(row[7]), ram / std::pow(2.0, 30), "host RAM GiB");
  EXPECT_NEAR(number(row[8]), ram / (2048 * std::pow(2.0, 30)), 0.006);
  // (2 + 16) B per element on one 46.8 GB/s core against a 2 s step: 2
  // cores, below one worker per rank.
  EXPECT_EQ(row[9], "8");
  EXPECT_EQ(row[10], "2");
  const double ema = std::max({perRank * 2 / 30e9, hostBytes / 400e9, perNode * 18 / 46.8e9 / 8});
  expectNear3(number(row[11]), ema * 1e3, "EMA ms");
  expectNear3(number(row[12]), 100 * 1.4e-3 / 2, "overhead, update_every 1");
  expectNear3(number(row[13]), 100 * 1.4e-3 / 4 / 2, "overhead, update_every 4");
  EXPECT_NE(result.out.find("| overhead, update_every 4 |"), std::string::npos);
}

// One row per --parameters x --ranks pair, parameters outermost, as typed.
TEST(PlanCommandTest, RowsComeInTheOrderAsked) {
  const CliResult result = runCli("plan --parameters 405e9,7000000000 --ranks 1024,8");
  ASSERT_EQ(result.status, 0) << result.err;
  const auto rows = rowsOf(result.out);
  ASSERT_EQ(rows.size(), 4u);
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"405e9", "1024"}, {"405e9", "8"}, {"7000000000", "1024"}, {"7000000000", "8"}};
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i][0], expected[i].first);
    EXPECT_EQ(rows[i][1], expected[i].second);
  }
  // The default columns: update_every 1 and 10.
  EXPECT_NE(result.out.find("overhead, update_every 1 | overhead, update_every 10 |"),
            std::string::npos);
  EXPECT_EQ(result.out.rfind("inputs: 8 GPUs per node; 4-byte sources;", 0), 0u) << result.out;
}

void expectUsageError(const std::string& args, const std::string& named) {
  const CliResult result = runCli(args);
  EXPECT_EQ(result.status, 2) << args;
  EXPECT_TRUE(result.out.empty()) << args << " printed: " << result.out;
  EXPECT_EQ(result.err.rfind("shardema plan: ", 0), 0u) << args << ": " << result.err;
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_NE(result.err.find(named), std::string::npos)
      << args << ": '" << result.err << "' should name " << named;
}

TEST(PlanCommandTest, EachBadFlagIsNamedAndNothingIsPrinted) {
  expectUsageError("plan", "--parameters LIST is required");
  expectUsageError("plan --parameters 7.5", "--parameters: '7.5' must be a whole number");
  expectUsageError("plan --parameters 0", "--parameters: '0'");
  expectUsageError("plan --parameters 7e9,", "parameters");
  expectUsageError("plan --parameters 7e9 --ranks 8,0", "--ranks: '0' must be >= 1");
  expectUsageError("plan --parameters 7e9 --update-every 0", "--update-every: '0'");
  expectUsageError("plan --parameters 7e9 --pcie-gbps 0", "--pcie-gbps (0) must be > 0");
  expectUsageError("plan --parameters 7e9 --source-bytes 8", "--source-bytes (8) must be 2");
  expectUsageError("plan --parameters 7e9 --profiles 17", "--profiles (17) must be in [1, 16]");
  expectUsageError("plan --parameters 7e9 --gpus-per-node 0", "--gpus-per-node (0)");
  expectUsageError("plan --parameters 7e9 --step-seconds -1", "--step-seconds (-1)");
  expectUsageError("plan --parameters 7e9 --node-ram-gib x", "node-ram-gib");
  expectUsageError("plan --parameters 7e9 --colour blue", "colour");
  // A bad world size later in the list still prints nothing.
  expectUsageError("plan --parameters 7e9,70e9 --ranks 8 --gpus-per-node 0", "--gpus-per-node");
}

TEST(PlanCommandTest, HelpNamesEveryFlag) {
  const CliResult result = runCli("plan --help");
  ASSERT_EQ(result.status, 0);
  for (const char* flag :
       {"--parameters", "--ranks", "--gpus-per-node", "--source-bytes", "--profiles", "--pcie-gbps",
        "--host-memory-gbps", "--core-gbps", "--step-seconds", "--tokens-per-gpu", "--gpu-tflops",
        "--staging-bytes-per-rank", "--update-call-seconds", "--node-ram-gib", "--update-every"}) {
    EXPECT_NE(result.out.find(flag), std::string::npos) << flag;
  }
  EXPECT_NE(runCli("--help").out.find("  plan "), std::string::npos);
}

}  // namespace
