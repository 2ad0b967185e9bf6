// Runs the real `shardema` binary and checks its output against values the
// test recomputes itself in float64 (formulas of docs/spec/reference_semantics.md section 7) or
// reads from the golden files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tools/cli_run.h"

namespace {

using nlohmann::json;

using shardema::testing::CliResult;
using shardema::testing::runCli;

std::vector<std::pair<int64_t, double>> parseStepLines(const std::string& out) {
  std::vector<std::pair<int64_t, double>> lines;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("reach ", 0) == 0) continue;
    std::istringstream fields(line);
    long long n = 0;
    std::string value;
    fields >> n >> value;
    lines.emplace_back(n, std::strtod(value.c_str(), nullptr));  // %.17g parses back exactly
  }
  return lines;
}

// "reach <target> <n|never>" lines, as (target text, n text).
std::vector<std::pair<std::string, std::string>> parseReachLines(const std::string& out) {
  std::vector<std::pair<std::string, std::string>> lines;
  std::istringstream in(out);
  std::string word, target, n;
  while (in >> word) {
    if (word != "reach") {
      std::getline(in, word);  // rest of an "n value" line
      continue;
    }
    in >> target >> n;
    lines.emplace_back(target, n);
  }
  return lines;
}

// Spec section 7, written out again here rather than taken from the library.
double warmupDecay(int64_t n, double invGamma, double power, double minValue, double maxValue,
                   int64_t updateAfterStep) {
  const int64_t e = std::max<int64_t>(0, n - updateAfterStep - 1);
  if (e <= 0) return 0.0;
  const double value = 1.0 - std::pow(1.0 + double(e) / invGamma, -power);
  return std::min(std::max(value, minValue), maxValue);
}

void expectUsageError(const std::string& args, const std::string& flag) {
  const CliResult result = runCli(args);
  EXPECT_EQ(result.status, 2) << args;
  EXPECT_TRUE(result.out.empty()) << args << " printed: " << result.out;
  EXPECT_EQ(result.err.rfind("shardema schedule: ", 0), 0u) << args << ": " << result.err;
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_NE(result.err.find(flag), std::string::npos)
      << args << ": '" << result.err << "' should name " << flag;
}

TEST(ScheduleCommandTest, WarmupStepsMatchGoldenAndFloat64Formula) {
  std::ifstream in(std::string(SHARDEMA_TEST_DATA_DIR) + "/warmup_decay_schedule.json");
  const json golden = json::parse(in);
  const json* shortRun = nullptr;
  for (const json& item : golden["cases"]) {
    if (item["settings"]["name"] == "short_run") shortRun = &item;
  }
  ASSERT_NE(shortRun, nullptr);
  // short_run: beta 0.999, update_after_step 0, inv_gamma 1, power 0.75, min 0.
  const CliResult result = runCli(
      "schedule --kind warmup --power 0.75 --max-value 0.999 --inv-gamma 1 --min-value 0 "
      "--update-after-step 0 --steps 1-40,99-102,150,1000,10000,31623,215444,1000000");
  ASSERT_EQ(result.status, 0) << result.err;
  const auto lines = parseStepLines(result.out);
  const auto steps = (*shortRun)["step_buffer_values"].get<std::vector<int64_t>>();
  const auto decay = (*shortRun)["decay"].get<std::vector<double>>();
  ASSERT_EQ(lines.size() + 1, steps.size()) << "golden step 0 is not a valid n";
  for (size_t i = 0; i < lines.size(); ++i) {
    ASSERT_EQ(lines[i].first, steps[i + 1]);
    // 1e-7: the golden values are ema-pytorch float32 (up to ~5e-8 off float64).
    EXPECT_NEAR(lines[i].second, decay[i + 1], 1e-7) << "n " << lines[i].first;
    EXPECT_DOUBLE_EQ(lines[i].second, warmupDecay(lines[i].first, 1.0, 0.75, 0.0, 0.999, 0));
  }
}

TEST(ScheduleCommandTest, StepRangesWithStride) {
  const CliResult result =
      runCli("schedule --kind constant --decay 0.99 --steps 100-1000:100,5,1-11:3,7-7");
  ASSERT_EQ(result.status, 0) << result.err;
  std::vector<int64_t> ns;
  for (const auto& [n, value] : parseStepLines(result.out)) {
    ns.push_back(n);
    EXPECT_EQ(value, 0.99);
  }
  const std::vector<int64_t> expected = {100, 200,  300, 400, 500, 600, 700, 800,
                                         900, 1000, 5,   1,   4,   7,   10,  7};
  EXPECT_EQ(ns, expected);
  EXPECT_NE(result.out.find("5 0.98999999999999999\n"), std::string::npos) << "%.17g";
}

TEST(ScheduleCommandTest, PowerStepsMatchGolden) {
  std::ifstream in(std::string(SHARDEMA_TEST_DATA_DIR) + "/karras_gamma_beta.json");
  const json golden = json::parse(in);
  const json& profile = golden["betas"]["0.05"];
  // nitrous update call c is step n = c + 1: calls 0, 10, ..., 190 are n = 1, 11, ..., 191.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--update-every 10 --step-size-correction --steps 1-191:10",
       "nitrous_beta_update_every10_correctionTrue"},
      {"--update-every 10 --step-size-correction false --steps 1-191:10",
       "nitrous_beta_update_every10_correctionFalse"},
      {"--step-size-correction=true --steps 1-20", "nitrous_beta_update_every1_correctionTrue"},
      {"--convention nitrous --steps 1-20", "nitrous_beta_update_every1_correctionFalse"},
  };
  for (const auto& [flags, key] : cases) {
    const CliResult result = runCli("schedule --kind power --sigma-rel 0.05 " + flags);
    ASSERT_EQ(result.status, 0) << flags << ": " << result.err;
    const auto lines = parseStepLines(result.out);
    const auto betas = profile[key]["beta"].get<std::vector<double>>();
    ASSERT_EQ(lines.size(), betas.size()) << flags;
    for (size_t i = 0; i < lines.size(); ++i) {
      EXPECT_NEAR(lines[i].second, betas[i], 1e-7) << key << " n " << lines[i].first;
    }
  }
  const double gamma = profile["gamma"].get<double>();
  char gammaText[32];
  std::snprintf(gammaText, sizeof(gammaText), "%.17g", gamma);
  const CliResult edm2 = runCli(std::string("schedule --kind power --convention edm2 --gamma ") +
                                gammaText + " --steps 1-20");
  ASSERT_EQ(edm2.status, 0) << edm2.err;
  const auto lines = parseStepLines(edm2.out);
  const auto betas = profile["edm2_power_function_beta_t_next_n_delta_1"]["beta"];
  ASSERT_EQ(lines.size(), betas.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_NEAR(lines[i].second, betas[i].get<double>(), 1e-7) << "edm2 n " << lines[i].first;
    const double n = double(lines[i].first);
    EXPECT_NEAR(lines[i].second, std::pow(1.0 - 1.0 / n, gamma + 1.0), 1e-14);
  }
}

// First n with value(n) >= target by a plain float64 scan from a closed-form
// guess; value must be the test's own formula.
template <class Value>
int64_t reachByScan(double target, double guess, Value value) {
  int64_t n = std::max<int64_t>(1, int64_t(guess) - 3);
  while (n > 1 && value(n - 1) >= target) --n;
  while (value(n) < target) ++n;
  return n;
}

TEST(ScheduleCommandTest, WarmupReachMatchesIndependentComputation) {
  const CliResult result =
      runCli("schedule --kind warmup --power 0.75 --max-value 1 --reach 0.999,0.9999,0.5,0");
  ASSERT_EQ(result.status, 0) << result.err;
  const auto lines = parseReachLines(result.out);
  ASSERT_EQ(lines.size(), 4u) << result.out;
  const auto value = [](int64_t n) { return warmupDecay(n, 1.0, 0.75, 0.0, 1.0, 0); };
  const std::vector<std::pair<std::string, double>> targets = {
      {"0.999", 0.999}, {"0.9999", 0.9999}, {"0.5", 0.5}, {"0", 0.0}};
  for (size_t i = 0; i < targets.size(); ++i) {
    const double target = targets[i].second;
    // 1 - n^-0.75 >= t  <=>  n >= (1 - t)^(-4/3)
    const double guess = target == 0.0 ? 1.0 : std::pow(1.0 - target, -1.0 / 0.75);
    EXPECT_EQ(lines[i].first, targets[i].first) << "target echoed as typed";
    EXPECT_EQ(lines[i].second, std::to_string(reachByScan(target, guess, value)))
        << targets[i].first;
  }
  // The spec's numbers (section 1): power 3/4 reaches 0.999 at 10k, 0.9999 at 215.4k.
  EXPECT_EQ(lines[0].second, "10000");
  EXPECT_EQ(lines[1].second, "215444");
  EXPECT_EQ(lines[3].second, "1");
}

TEST(ScheduleCommandTest, ClampedWarmupReachMatchesLinearScan) {
  const CliResult result = runCli(
      "schedule --kind warmup --update-after-step 5 --inv-gamma 10 --power 1 --min-value 0.5 "
      "--max-value 0.99 --reach 0.4,0.5,0.6,0.75,0.99,0.995");
  ASSERT_EQ(result.status, 0) << result.err;
  const auto lines = parseReachLines(result.out);
  ASSERT_EQ(lines.size(), 6u);
  const auto value = [](int64_t n) { return warmupDecay(n, 10.0, 1.0, 0.5, 0.99, 5); };
  const double targets[] = {0.4, 0.5, 0.6, 0.75, 0.99};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(lines[i].second, std::to_string(reachByScan(targets[i], 1.0, value)))
        << lines[i].first;
  }
  EXPECT_EQ(lines[0].second, "7") << "the first averaging step is already at min_value";
  EXPECT_EQ(lines[5].second, "never") << "above max_value";
}

TEST(ScheduleCommandTest, PowerReachAgreesWithClosedFormAndStepsOutput) {
  const std::string schedule = "schedule --kind power --sigma-rel 0.05 ";
  const CliResult result = runCli(schedule + "--reach 0.9,0.99,0.999999,1");
  ASSERT_EQ(result.status, 0) << result.err;
  const auto lines = parseReachLines(result.out);
  ASSERT_EQ(lines.size(), 4u);
  const double gamma = 16.972198602303447;  // golden sigma_rel 0.05
  const double targets[] = {0.9, 0.99, 0.999999};
  for (size_t i = 0; i < 3; ++i) {
    // (n/(n+1))^(g+1) >= t  <=>  n >= r/(1-r), r = t^(1/(g+1))
    const double r = std::pow(targets[i], 1.0 / (gamma + 1.0));
    const int64_t closedForm = int64_t(std::ceil(r / (1.0 - r)));
    const int64_t n = std::stoll(lines[i].second);
    EXPECT_LE(std::llabs(n - closedForm), 1) << lines[i].first;
    // And the CLI's own values bracket the target at n.
    const auto values = parseStepLines(
        runCli(schedule + "--steps " + std::to_string(n - 1) + "-" + std::to_string(n)).out);
    ASSERT_EQ(values.size(), 2u);
    EXPECT_LT(values[0].second, targets[i]);
    EXPECT_GE(values[1].second, targets[i]);
  }
  // beta rounds to exactly 1 once (g+1)/(n+1) is below half an ulp of 1.
  EXPECT_NE(lines[3].second, "never");
}

TEST(ScheduleCommandTest, HelpExitsZero) {
  const CliResult top = runCli("--help");
  EXPECT_EQ(top.status, 0);
  EXPECT_NE(top.out.find("schedule"), std::string::npos) << top.out;
  const CliResult schedule = runCli("schedule --help");
  EXPECT_EQ(schedule.status, 0);
  for (const char* flag : {"--steps", "--reach", "--kind", "--sigma-rel", "--inv-gamma", ":"}) {
    EXPECT_NE(schedule.out.find(flag), std::string::npos) << flag;
  }
  EXPECT_EQ(runCli("").status, 2);
  const CliResult unknown = runCli("scheduel");
  EXPECT_EQ(unknown.status, 2);
  EXPECT_NE(unknown.err.find("scheduel"), std::string::npos);
}

TEST(ScheduleCommandTest, FlagErrorsNameTheFlag) {
  expectUsageError("schedule --kind warmup --bogus 1 --steps 1", "--bogus");
  expectUsageError("schedule --kind warmup --power", "--power");
  expectUsageError("schedule --kind warmup --power --steps 1", "--power");
  expectUsageError("schedule --kind warmup --power abc --steps 1", "--power");
  expectUsageError("schedule --kind warmup --update-every 1.5 --steps 1", "--update-every");
  expectUsageError("schedule --kind warmup --kind power --steps 1", "--kind");
  expectUsageError("schedule --steps 1", "--kind");
  expectUsageError("schedule --kind linear --steps 1", "--kind");
  expectUsageError("schedule --kind warmup", "--steps");
  expectUsageError("schedule --kind warmup stray --steps 1", "stray");
  expectUsageError("schedule --kind power --step-size-correction=maybe --steps 1",
                   "--step-size-correction");
}

TEST(ScheduleCommandTest, FlagsOfAnotherKindAreErrors) {
  expectUsageError("schedule --kind warmup --gamma 5 --steps 1", "--gamma");
  expectUsageError("schedule --kind warmup --step-size-correction --steps 1",
                   "--step-size-correction");
  expectUsageError("schedule --kind power --power 0.5 --steps 1", "--power");
  expectUsageError("schedule --kind power --decay 0.5 --steps 1", "--decay");
  expectUsageError("schedule --kind constant --sigma-rel 0.1 --steps 1", "--sigma-rel");
  expectUsageError("schedule --kind power --sigma-rel 0.1 --gamma 5 --steps 1", "--gamma");
}

TEST(ScheduleCommandTest, BadValuesNameTheFlag) {
  expectUsageError("schedule --kind warmup --min-value 0.9 --max-value 0.5 --steps 1",
                   "--min-value");
  expectUsageError("schedule --kind warmup --max-value 1.5 --steps 1", "--max-value");
  expectUsageError("schedule --kind warmup --inv-gamma 0 --steps 1", "--inv-gamma");
  expectUsageError("schedule --kind warmup --power -1 --steps 1", "--power");
  expectUsageError("schedule --kind warmup --update-after-step -1 --steps 1",
                   "--update-after-step");
  expectUsageError("schedule --kind warmup --update-every 0 --steps 1", "--update-every");
  expectUsageError("schedule --kind power --sigma-rel 0.3 --steps 1", "--sigma-rel");
  expectUsageError("schedule --kind power --gamma -1 --steps 1", "--gamma");
  expectUsageError("schedule --kind power --gamma 0 --steps 1", "--gamma");
  expectUsageError("schedule --kind power --convention karras --steps 1", "--convention");
  expectUsageError("schedule --kind constant --decay 1.5 --steps 1", "--decay");
  expectUsageError("schedule --kind constant --decay nan --steps 1", "--decay");
}

TEST(ScheduleCommandTest, BadListsNameTheFlag) {
  for (const char* steps : {"0", "5-3", "1,,2", "x", "1-10:0", "-3", "1-", "2:5"}) {
    expectUsageError(std::string("schedule --kind warmup --steps ") + steps, "--steps");
  }
  for (const char* reach : {"1.5", "-0.1", "0.9,", "high"}) {
    expectUsageError(std::string("schedule --kind warmup --steps 1 --reach ") + reach, "--reach");
  }
}

}  // namespace
