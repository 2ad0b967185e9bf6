#include "shardema/core/power_function.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "step_check.h"

namespace shardema {
namespace {

// The cubic of Algorithm 2 is (g+2)^2 (g+3) - q (g+1) with q = sigma^-2
// (Eq. 123 rearranged). Divided by (g+1) > 0 it becomes
// h(g) = g^2 + 6g + 10 + 2/(g+1) - q, which has the same roots for g > -1,
// is increasing and convex on g >= 0, and evaluates with an absolute error of
// a few ulps of q, i.e. the root comes out to about an ulp of gamma.
double reducedCubic(double g, double q) { return (g + 6.0) * g + 10.0 + 2.0 / (g + 1.0) - q; }

double reducedCubicSlope(double g) { return 2.0 * g + 6.0 - 2.0 / ((g + 1.0) * (g + 1.0)); }

// log of the plain beta: (gamma+1) log(1 - 1/m) with m = n+1 (nitrous) or
// m = n (edm2). log1p keeps the accuracy when 1/m is tiny (long runs), where
// pow(1 - 1/m, .) would inherit the rounding of 1 - 1/m times gamma+1.
double logPlainBeta(double gamma, double n, BetaConvention convention) {
  const double m = convention == BetaConvention::kNitrous ? n + 1.0 : n;
  return (gamma + 1.0) * std::log1p(-1.0 / m);  // -inf at m = 1: beta 0
}

void checkGamma(const char* api, double gamma) {
  TORCH_CHECK_VALUE(std::isfinite(gamma) && gamma > 0.0, api, ": gamma (", gamma,
                    ") must be finite and > 0");
}

using detail::checkStep;

}  // namespace

double sigmaRelToGamma(double sigmaRel) {
  TORCH_CHECK_VALUE(sigmaRel > 0.0 && sigmaRel < kMaxSigmaRel, "sigmaRelToGamma: sigma_rel (",
                    sigmaRel, ") must lie in (0, ", kMaxSigmaRel,
                    "); larger values have no power profile");
  const double q = 1.0 / (sigmaRel * sigmaRel);
  TORCH_CHECK_VALUE(std::isfinite(q), "sigmaRelToGamma: sigma_rel (", sigmaRel,
                    ") is too small: 1/sigma_rel^2 overflows a double");
  // h(g) > g^2 - q, so h(1/sigma) > 0 and the largest root lies in
  // (0, 1/sigma). Newton started right of the root of an increasing convex
  // function decreases monotonically onto it; stop as soon as an iterate
  // fails to decrease, which is where rounding takes over.
  double g = 1.0 / sigmaRel;
  for (int i = 0; i < 200; ++i) {
    const double next = g - reducedCubic(g, q) / reducedCubicSlope(g);
    if (!(next < g)) break;
    g = next;
  }
  // Polish: the monotone stop can leave us an ulp above the best root.
  const double below = std::nextafter(g, 0.0);
  if (std::fabs(reducedCubic(below, q)) < std::fabs(reducedCubic(g, q))) g = below;
  TORCH_INTERNAL_ASSERT(g > 0.0 && std::isfinite(g), "sigmaRelToGamma: no root for ", sigmaRel);
  return g;
}

double gammaToSigmaRel(double gamma) {
  checkGamma("gammaToSigmaRel", gamma);
  // Divided out term by term so that huge gammas do not overflow (g+2)^2.
  return std::sqrt((gamma + 1.0) / (gamma + 3.0)) / (gamma + 2.0);
}

double powerFunctionBeta(double gamma, int64_t n, BetaConvention convention) {
  checkGamma("powerFunctionBeta", gamma);
  checkStep("powerFunctionBeta", n);
  return std::exp(logPlainBeta(gamma, static_cast<double>(n), convention));
}

double correctedPowerFunctionBeta(double gamma, int64_t n, int64_t updateEvery,
                                  BetaConvention convention) {
  checkGamma("correctedPowerFunctionBeta", gamma);
  checkStep("correctedPowerFunctionBeta", n);
  TORCH_CHECK_VALUE(updateEvery >= 1, "correctedPowerFunctionBeta: update_every (", updateEvery,
                    ") must be >= 1");
  // In double so that n + u cannot overflow int64 near the end of the range.
  const double dn = static_cast<double>(n);
  const double u = static_cast<double>(updateEvery);
  const double logSum =
      logPlainBeta(gamma, dn, convention) + logPlainBeta(gamma, dn + u, convention);
  return std::exp(0.5 * u * logSum);
}

}  // namespace shardema
