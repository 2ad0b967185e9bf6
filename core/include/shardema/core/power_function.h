#pragma once
// Power-function (Karras) EMA profile math, float64. Spec section 2.
#include <cstdint>

#include "shardema/core/decay_schedule.h"

namespace shardema {

/// Largest sigma_rel a power profile can have (gamma -> 0): sqrt(1/12),
/// about 0.288675; the references round it to 0.2887.
constexpr double kMaxSigmaRel = 0.28867513459481287;

/// gamma = largest real root of g^3 + 7 g^2 + (16 - s^-2) g + (12 - s^-2)
/// (paper Algorithm 2). sigmaRel must lie in (0, kMaxSigmaRel), else
/// c10::ValueError naming sigma_rel. Accurate to a few ulps.
double sigmaRelToGamma(double sigmaRel);

/// Inverse (paper Eq. 123): sqrt((g + 1) / ((g + 2)^2 (g + 3))). gamma > 0.
double gammaToSigmaRel(double gamma);

/// Plain beta at 1-based step n: nitrous (1 - 1/(n+1))^(gamma+1),
/// edm2 (1 - 1/n)^(gamma+1).
double powerFunctionBeta(double gamma, int64_t n, BetaConvention convention);

/// nitrous step_size_correction: [b(n) b(n + u)]^(u/2), b = powerFunctionBeta.
double correctedPowerFunctionBeta(double gamma, int64_t n, int64_t updateEvery,
                                  BetaConvention convention);

}  // namespace shardema
