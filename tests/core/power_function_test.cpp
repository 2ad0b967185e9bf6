#include "shardema/core/power_function.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/value_error.h"

namespace shardema {
namespace {

using nlohmann::json;

// The golden gammas come from np.roots in float64 and agree with each other to
// ~2e-15; the betas are float64 too. 1e-7 absolute is the contract the
// project promises against every golden file; the tighter checks below show
// how far inside it we are.
constexpr double kGoldenTolerance = 1e-7;

json loadGolden() {
  std::ifstream in(std::string(SHARDEMA_TEST_DATA_DIR) + "/karras_gamma_beta.json");
  EXPECT_TRUE(in.good()) << "missing tests/data/karras_gamma_beta.json";
  return json::parse(in);
}

// Expanded cubic of Algorithm 2 in long double, independent of the factored
// form the library evaluates.
long double paperCubic(long double g, long double sigma) {
  const long double q = 1.0L / (sigma * sigma);
  return ((g + 7.0L) * g + (16.0L - q)) * g + (12.0L - q);
}

TEST(PowerFunctionTest, SigmaRelToGammaMatchesGolden) {
  const json golden = loadGolden();
  const auto sigmas = golden["sigma_rel"].get<std::vector<double>>();
  const auto emaPytorch = golden["gamma_ema_pytorch"].get<std::vector<double>>();
  const auto edm2 = golden["gamma_edm2_std_to_exp"].get<std::vector<double>>();
  ASSERT_EQ(sigmas.size(), 6u);
  for (size_t i = 0; i < sigmas.size(); ++i) {
    const double gamma = sigmaRelToGamma(sigmas[i]);
    EXPECT_NEAR(gamma, emaPytorch[i], kGoldenTolerance) << "sigma_rel " << sigmas[i];
    EXPECT_NEAR(gamma, edm2[i], kGoldenTolerance) << "sigma_rel " << sigmas[i];
    // np.roots is itself accurate to a few ulps here.
    EXPECT_NEAR(gamma, emaPytorch[i], 1e-13 * emaPytorch[i]) << "sigma_rel " << sigmas[i];
  }
}

TEST(PowerFunctionTest, SigmaRelToGammaIsTheLargestRootOfTheCubic) {
  for (double sigma : {1e-5, 1e-3, 0.01, 0.05, 0.1, 0.2, 0.28, 0.2886, 0.28867}) {
    const long double g = sigmaRelToGamma(sigma);
    ASSERT_GT(g, 0.0L) << sigma;
    // A sign change within 1e-12 relative (+1e-14 absolute: near kMaxSigmaRel
    // gamma -> 0 and rounding sigma^-2 alone moves it by ~1e-15) of our gamma.
    const long double slack = 1e-12L * g + 1e-14L;
    EXPECT_LT(paperCubic(g - slack, sigma), 0.0L) << sigma;
    EXPECT_GT(paperCubic(g + slack, sigma), 0.0L) << sigma;
    // And no larger root: the cubic stays positive on a sweep above it.
    for (long double x = g + 1e-6L * g + 1e-12L; x < 10.0L * g + 10.0L; x *= 1.01L) {
      ASSERT_GT(paperCubic(x, sigma), 0.0L) << "sigma " << sigma << " x " << (double)x;
    }
  }
}

TEST(PowerFunctionTest, GammaToSigmaRelInvertsSigmaRelToGamma) {
  for (double sigma = 1e-4; sigma < kMaxSigmaRel; sigma += 0.0007) {
    EXPECT_NEAR(gammaToSigmaRel(sigmaRelToGamma(sigma)), sigma, 1e-12) << sigma;
  }
  for (double sigma : {1e-8, 0.05, 0.288, 0.28867}) {
    EXPECT_NEAR(gammaToSigmaRel(sigmaRelToGamma(sigma)), sigma, 1e-12) << sigma;
  }
  const json golden = loadGolden();
  const auto gammas = golden["gamma_edm2_std_to_exp"].get<std::vector<double>>();
  const auto roundTrip = golden["edm2_exp_to_std_roundtrip"].get<std::vector<double>>();
  for (size_t i = 0; i < gammas.size(); ++i) {
    EXPECT_NEAR(gammaToSigmaRel(gammas[i]), roundTrip[i], 1e-15) << gammas[i];
  }
}

TEST(PowerFunctionTest, SigmaRelToGammaDecreasesTowardZeroAtTheLimit) {
  double previous = std::numeric_limits<double>::infinity();
  for (double sigma = 0.001; sigma < kMaxSigmaRel; sigma += 0.001) {
    const double gamma = sigmaRelToGamma(sigma);
    EXPECT_LT(gamma, previous) << sigma;
    previous = gamma;
  }
  EXPECT_LT(sigmaRelToGamma(std::nextafter(kMaxSigmaRel, 0.0)), 1e-6);
}

TEST(PowerFunctionTest, RejectsSigmaRelOutsideTheOpenRange) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double sigma : {0.0, -0.05, kMaxSigmaRel, 0.2888, 0.3, 1.0, nan}) {
    EXPECT_VALUE_ERROR(sigmaRelToGamma(sigma), "sigma_rel");
  }
}

TEST(PowerFunctionTest, RejectsNonPositiveOrNonFiniteGamma) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double gamma : {0.0, -1.0, inf, nan}) {
    EXPECT_VALUE_ERROR(gammaToSigmaRel(gamma), "gamma");
    EXPECT_VALUE_ERROR(powerFunctionBeta(gamma, 5, BetaConvention::kNitrous), "gamma");
    EXPECT_VALUE_ERROR(correctedPowerFunctionBeta(gamma, 5, 2, BetaConvention::kEdm2), "gamma");
  }
}

TEST(PowerFunctionTest, RejectsStepBelowOneAndUpdateEveryBelowOne) {
  EXPECT_VALUE_ERROR(powerFunctionBeta(7.0, 0, BetaConvention::kNitrous), "n (0)");
  EXPECT_VALUE_ERROR(powerFunctionBeta(7.0, -3, BetaConvention::kEdm2), "n (-3)");
  EXPECT_VALUE_ERROR(correctedPowerFunctionBeta(7.0, 0, 1, BetaConvention::kNitrous), "n (0)");
  EXPECT_VALUE_ERROR(correctedPowerFunctionBeta(7.0, 1, 0, BetaConvention::kNitrous),
                     "update_every");
}

// Golden step mapping: nitrous/ema-pytorch update call c (0-based) is our
// 1-based step n = c + 1 (with update_every 10, calls 0, 10, 20 are n = 1,
// 11, 21); edm2's n is our n.
TEST(PowerFunctionTest, BetasMatchGolden) {
  const json golden = loadGolden();
  ASSERT_FALSE(golden["betas"].empty());
  for (const auto& item : golden["betas"].items()) {
    const json& profile = item.value();
    const double gamma = sigmaRelToGamma(profile["sigma_rel"].get<double>());
    EXPECT_NEAR(gamma, profile["gamma"].get<double>(), kGoldenTolerance);
    const auto checkCalls = [&](const char* key, int64_t every, bool corrected) {
      const auto calls = profile[key]["update_calls"].get<std::vector<int64_t>>();
      const auto betas = profile[key]["beta"].get<std::vector<double>>();
      ASSERT_EQ(calls.size(), betas.size());
      for (size_t i = 0; i < calls.size(); ++i) {
        const int64_t n = calls[i] + 1;
        const double beta =
            corrected ? correctedPowerFunctionBeta(gamma, n, every, BetaConvention::kNitrous)
                      : powerFunctionBeta(gamma, n, BetaConvention::kNitrous);
        EXPECT_NEAR(beta, betas[i], kGoldenTolerance) << key << " call " << calls[i];
        EXPECT_NEAR(beta, betas[i], 1e-13) << key << " call " << calls[i] << " (float64 ref)";
      }
    };
    checkCalls("nitrous_beta_update_every1_correctionFalse", 1, false);
    checkCalls("nitrous_beta_update_every1_correctionTrue", 1, true);
    checkCalls("nitrous_beta_update_every10_correctionFalse", 10, false);
    checkCalls("nitrous_beta_update_every10_correctionTrue", 10, true);
    const auto emaPytorch = profile["ema_pytorch_beta_per_update_call"].get<std::vector<double>>();
    for (size_t c = 0; c < emaPytorch.size(); ++c) {
      EXPECT_NEAR(powerFunctionBeta(gamma, int64_t(c) + 1, BetaConvention::kNitrous), emaPytorch[c],
                  kGoldenTolerance);
    }
    const json& edm2 = profile["edm2_power_function_beta_t_next_n_delta_1"];
    const auto ns = edm2["n"].get<std::vector<int64_t>>();
    const auto betas = edm2["beta"].get<std::vector<double>>();
    for (size_t i = 0; i < ns.size(); ++i) {
      EXPECT_NEAR(powerFunctionBeta(gamma, ns[i], BetaConvention::kEdm2), betas[i],
                  kGoldenTolerance)
          << "edm2 n " << ns[i];
    }
  }
}

TEST(PowerFunctionTest, ConventionsDifferByOneStep) {
  const double gamma = 6.9372;
  EXPECT_EQ(powerFunctionBeta(gamma, 1, BetaConvention::kEdm2), 0.0);
  EXPECT_NEAR(powerFunctionBeta(gamma, 1, BetaConvention::kNitrous), std::pow(0.5, gamma + 1),
              1e-16);
  for (int64_t n : {1, 2, 3, 10, 1000, 123456789}) {
    EXPECT_NEAR(powerFunctionBeta(gamma, n, BetaConvention::kNitrous),
                powerFunctionBeta(gamma, n + 1, BetaConvention::kEdm2), 1e-15)
        << n;
  }
}

TEST(PowerFunctionTest, CorrectionIsTheGeometricMeanPowerEvenForUpdateEveryOne) {
  const double gamma = 16.97;
  for (int64_t n : {1, 2, 5, 50, 5000}) {
    const double plain = powerFunctionBeta(gamma, n, BetaConvention::kNitrous);
    const double next = powerFunctionBeta(gamma, n + 1, BetaConvention::kNitrous);
    const double corrected = correctedPowerFunctionBeta(gamma, n, 1, BetaConvention::kNitrous);
    EXPECT_NEAR(corrected, std::sqrt(plain * next), 1e-14 * (1 + corrected)) << n;
    EXPECT_GT(corrected, plain) << "u = 1 does not reduce to the plain beta, n " << n;
    const double later = powerFunctionBeta(gamma, n + 10, BetaConvention::kNitrous);
    EXPECT_NEAR(correctedPowerFunctionBeta(gamma, n, 10, BetaConvention::kNitrous),
                std::pow(plain * later, 5.0), 1e-13)
        << n;
  }
  EXPECT_EQ(correctedPowerFunctionBeta(gamma, 1, 4, BetaConvention::kEdm2), 0.0);
}

TEST(PowerFunctionTest, BetaIsNonDecreasingAndBoundedUpToTwoToThe62) {
  for (BetaConvention convention : {BetaConvention::kNitrous, BetaConvention::kEdm2}) {
    double plainBefore = 0.0;
    double correctedBefore = 0.0;
    for (int shift = 0; shift <= 62; ++shift) {
      const int64_t n = int64_t(1) << shift;
      const double plain = powerFunctionBeta(0.17, n, convention);
      const double corrected = correctedPowerFunctionBeta(16.97, n, 1000, convention);
      EXPECT_GE(plain, plainBefore) << n;
      EXPECT_GE(corrected, correctedBefore) << n;
      EXPECT_LE(plain, 1.0);
      EXPECT_LE(corrected, 1.0);
      plainBefore = plain;
      correctedBefore = corrected;
    }
    // Long runs keep full precision (an ulp of 1): 1 - (1 - 1/n)^7 = 7/n - 21/n^2 + ...,
    // whereas pow(1 - 1/n, 7) would carry 7 times the rounding of 1 - 1/n.
    const double n = 1e12 + 7;
    EXPECT_NEAR(1.0 - powerFunctionBeta(6.0, int64_t(n), BetaConvention::kEdm2),
                7.0 / n - 21.0 / (n * n), 2.5e-16);
    EXPECT_EQ(powerFunctionBeta(6.0, std::numeric_limits<int64_t>::max(), convention), 1.0);
  }
}

}  // namespace
}  // namespace shardema
