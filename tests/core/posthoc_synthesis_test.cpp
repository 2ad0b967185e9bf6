#include "shardema/core/posthoc_synthesis.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/core/power_function.h"
#include "support/value_error.h"

namespace shardema {
namespace {

using nlohmann::json;

// The contract against the reference runs.
constexpr double kGoldenTolerance = 1e-6;

json loadGolden() {
  std::ifstream in(std::string(SHARDEMA_TEST_DATA_DIR) + "/posthoc_ema_run.json");
  EXPECT_TRUE(in.good()) << "missing tests/data/posthoc_ema_run.json";
  return json::parse(in);
}

// The golden runs track sigma_rels (0.05, 0.1); file "{i}.{t}.pt" is
// profile i at step t.
struct GoldenFile {
  std::string name;
  SnapshotProfile profile;
};

std::vector<GoldenFile> goldenFiles(const json& run) {
  const double gammas[2] = {sigmaRelToGamma(0.05), sigmaRelToGamma(0.1)};
  std::vector<GoldenFile> files;
  for (const auto& name : run.at("snapshot_files")) {
    const std::string text = name.get<std::string>();
    const size_t dot = text.find('.');
    const int index = std::stoi(text.substr(0, dot));
    const int64_t step = std::stoll(text.substr(dot + 1));
    files.push_back({text, {step, gammas[index]}});
  }
  return files;
}

// Target sigma_rel and step of a "synthesized" key such as "0.08@step50".
void parseTarget(const json& entry, double* sigma, int64_t* step) {
  *sigma = entry.at("target_sigma_rel").get<double>();
  *step = entry.at("target_step").get<int64_t>();
}

TEST(PostHocSynthesisTest, InnerProductIsSymmetricAndMatchesTheClosedForm) {
  // Independent form: the integral of the two normalised power profiles
  // p(tau) = (g+1) tau^g / t^(g+1) on [0, min(ta, tb)], evaluated in closed
  // form here as (ga+1)(gb+1) m^(ga+gb+1) / ((ga+gb+1) ta^(ga+1) tb^(gb+1)).
  const double ga = 6.5, gb = 16.9;
  for (int64_t ta : {1, 7, 100, 5000}) {
    for (int64_t tb : {1, 9, 100, 12345}) {
      const double m = static_cast<double>(std::min(ta, tb));
      const double expected =
          (ga + 1) * (gb + 1) * std::pow(m, ga + gb + 1) /
          ((ga + gb + 1) * std::pow(double(ta), ga + 1) * std::pow(double(tb), gb + 1));
      const double got = profileInnerProduct(ta, ga, tb, gb);
      EXPECT_NEAR(got, expected, 1e-12 * expected) << ta << " " << tb;
      EXPECT_NEAR(got, profileInnerProduct(tb, gb, ta, ga), 1e-14 * expected);
    }
  }
  EXPECT_VALUE_ERROR(profileInnerProduct(0, ga, 1, gb), "step");
  EXPECT_VALUE_ERROR(profileInnerProduct(1, -1.0, 1, gb), "gamma");
}

TEST(PostHocSynthesisTest, WeightsMatchEveryGoldenRun) {
  const json golden = loadGolden();
  int checked = 0;
  for (const auto& run : golden.at("runs")) {
    const std::vector<GoldenFile> files = goldenFiles(run);
    std::vector<SnapshotProfile> profiles;
    for (const auto& f : files) profiles.push_back(f.profile);
    for (const auto& item : run.at("synthesized").items()) {
      double sigma = 0;
      int64_t step = 0;
      parseTarget(item.value(), &sigma, &step);
      const SynthesisWeights w = solveSynthesisWeights(profiles, sigma, step);
      const auto& expected = item.value().at("combination_weights");
      for (size_t i = 0; i < files.size(); ++i) {
        // The references solve over every file, we leave out t > t_r; in
        // exact arithmetic those weights are 0 (golden: below 5e-16).
        EXPECT_EQ(w.used[i], files[i].profile.step <= step);
        EXPECT_NEAR(w.weights[i], expected.at(files[i].name).get<double>(), kGoldenTolerance)
            << run.at("run") << " " << item.key() << " " << files[i].name;
      }
      EXPECT_NEAR(w.sum, item.value().at("sum_of_weights").get<double>(), kGoldenTolerance)
          << run.at("run") << " " << item.key();
      EXPECT_EQ(w.targetStep, step);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 30);  // 6 runs x 5 targets
}

TEST(PostHocSynthesisTest, TargetStepDefaultsToTheNewestSnapshot) {
  const json run = loadGolden().at("runs").at(0);
  std::vector<SnapshotProfile> profiles;
  for (const auto& f : goldenFiles(run)) profiles.push_back(f.profile);
  const SynthesisWeights byDefault = solveSynthesisWeights(profiles, 0.08);
  const SynthesisWeights explicitStep = solveSynthesisWeights(profiles, 0.08, 100);
  EXPECT_EQ(byDefault.targetStep, 100);
  EXPECT_EQ(byDefault.weights, explicitStep.weights);
  // numpy.linalg.cond(A, 1) of the same 20 x 20 Gram matrix (numpy,
  // profiles from np.roots as in the references).
  EXPECT_NEAR(byDefault.conditionNumber, 1661.7425361603516, 1e-6 * 1661.7425361603516);
  EXPECT_FALSE(byDefault.badlyConditioned);
}

// Synthesized theta = sum_i w_i snapshot_i over the lucid_fp32 run, whose
// every snapshot is listed; the reference accumulates in float32.
TEST(PostHocSynthesisTest, SynthesizedThetaMatchesGolden) {
  const json run = loadGolden().at("runs").at(0);
  ASSERT_EQ(run.at("run"), "lucid_fp32");
  const std::vector<GoldenFile> files = goldenFiles(run);
  std::vector<SnapshotProfile> profiles;
  std::vector<std::vector<double>> values;
  for (size_t i = 0; i < files.size(); ++i) {
    const auto& snapshot = run.at("snapshots").at(i);
    ASSERT_EQ(snapshot.at("file"), files[i].name);
    profiles.push_back(files[i].profile);
    values.push_back(
        snapshot.at("contents").at("ema_model.theta").at("values").get<std::vector<double>>());
  }
  for (const auto& item : run.at("synthesized").items()) {
    double sigma = 0;
    int64_t step = 0;
    parseTarget(item.value(), &sigma, &step);
    const SynthesisWeights w = solveSynthesisWeights(profiles, sigma, step);
    const auto expected = item.value().at("synthesized_theta").get<std::vector<double>>();
    for (size_t e = 0; e < expected.size(); ++e) {
      double sum = 0.0;
      for (size_t i = 0; i < files.size(); ++i) sum += w.weights[i] * values[i][e];
      EXPECT_NEAR(sum, expected[e], kGoldenTolerance) << item.key() << " element " << e;
    }
  }
}

TEST(PostHocSynthesisTest, NormalizeMakesTheWeightsSumToOne) {
  const json run = loadGolden().at("runs").at(0);
  std::vector<SnapshotProfile> profiles;
  for (const auto& f : goldenFiles(run)) profiles.push_back(f.profile);
  SynthesisOptions options;
  options.normalize = true;
  const SynthesisWeights raw = solveSynthesisWeights(profiles, 0.15);
  const SynthesisWeights normalized = solveSynthesisWeights(profiles, 0.15, 0, options);
  EXPECT_NEAR(raw.sum, 0.9974714108690335, kGoldenTolerance);  // golden raw sum
  EXPECT_NEAR(normalized.sum, 1.0, 1e-12);
  for (size_t i = 0; i < profiles.size(); ++i) {
    EXPECT_NEAR(normalized.weights[i], raw.weights[i] / raw.sum, 1e-12);
  }
}

// Two snapshots: A = [[a, c], [c, d]] has the inverse [[d, -c], [-c, a]] / det,
// so the 1-norm condition number is known in closed form.
TEST(PostHocSynthesisTest, ConditionNumberAndWarning) {
  const std::vector<SnapshotProfile> two = {{10, sigmaRelToGamma(0.05)},
                                            {10, sigmaRelToGamma(0.1)}};
  const double a = profileInnerProduct(10, two[0].gamma, 10, two[0].gamma);
  const double c = profileInnerProduct(10, two[0].gamma, 10, two[1].gamma);
  const double d = profileInnerProduct(10, two[1].gamma, 10, two[1].gamma);
  const double det = a * d - c * c;
  const double norm = std::max(a + c, c + d);
  const double inverseNorm = std::max(d + c, c + a) / det;
  SynthesisOptions options;
  const SynthesisWeights w = solveSynthesisWeights(two, 0.08, 0, options);
  EXPECT_NEAR(w.conditionNumber, norm * inverseNorm, 1e-9 * norm * inverseNorm);
  EXPECT_FALSE(w.badlyConditioned);
  options.warnConditionAbove = w.conditionNumber / 2;
  EXPECT_TRUE(solveSynthesisWeights(two, 0.08, 0, options).badlyConditioned);
  // Same-gamma target inside the span: the weights pick that snapshot.
  const SynthesisWeights exact = solveSynthesisWeights(two, 0.1);
  EXPECT_NEAR(exact.weights[0], 0.0, 1e-12);
  EXPECT_NEAR(exact.weights[1], 1.0, 1e-12);
}

TEST(PostHocSynthesisTest, BadInputIsRefusedNamingTheProblem) {
  const double g1 = sigmaRelToGamma(0.05), g2 = sigmaRelToGamma(0.1);
  const std::vector<SnapshotProfile> good = {{10, g1}, {10, g2}, {20, g1}, {20, g2}};
  EXPECT_VALUE_ERROR(solveSynthesisWeights(good, 0.0), "sigma_rel");
  EXPECT_VALUE_ERROR(solveSynthesisWeights(good, 0.2887), "sigma_rel");
  EXPECT_VALUE_ERROR(solveSynthesisWeights(good, -0.1), "sigma_rel");
  EXPECT_VALUE_ERROR(solveSynthesisWeights(good, 0.08, 21), "beyond the newest");
  EXPECT_VALUE_ERROR(solveSynthesisWeights(good, 0.08, -1), "target step");
  EXPECT_VALUE_ERROR(solveSynthesisWeights({}, 0.08), "at least two");
  EXPECT_VALUE_ERROR(solveSynthesisWeights({{10, g1}}, 0.08), "at least two");
  // Only one snapshot at or before the target.
  EXPECT_VALUE_ERROR(solveSynthesisWeights({{5, g1}, {20, g2}}, 0.08, 10), "at least two");
  EXPECT_VALUE_ERROR(solveSynthesisWeights({{10, g1}, {20, g2}, {10, g1}}, 0.08),
                     "same (step, gamma)");
  EXPECT_VALUE_ERROR(solveSynthesisWeights({{0, g1}, {10, g2}}, 0.08), "step");
  EXPECT_VALUE_ERROR(solveSynthesisWeights({{10, 0.0}, {10, g2}}, 0.08), "gamma");
  // Filtering: the t = 20 snapshots drop out at t_r = 10.
  const SynthesisWeights w = solveSynthesisWeights(good, 0.08, 10);
  EXPECT_TRUE(w.used[0] && w.used[1]);
  EXPECT_FALSE(w.used[2] || w.used[3]);
  EXPECT_EQ(w.weights[2], 0.0);
  EXPECT_EQ(w.weights[3], 0.0);
}

}  // namespace
}  // namespace shardema
