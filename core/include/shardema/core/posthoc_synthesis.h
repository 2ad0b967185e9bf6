#pragma once
// Post-hoc EMA synthesis weights (Karras et al., Algorithm 3; docs/spec/reference_semantics.md
// sections 3 and 7): which linear combination of saved power-function snapshots best approximates
// the EMA profile of another sigma_rel at a target step. Pure float64 math, no tensors: the
// file-level synthesis multiplies the snapshots' tensors by these weights.
#include <cstdint>
#include <vector>

namespace shardema {

/// One saved snapshot: the optimizer step it was taken at (t >= 1) and the
/// exponent gamma of its profile.
struct SnapshotProfile {
  int64_t step = 0;
  double gamma = 0.0;
};

/// Inner product of two power-function EMA profiles (the paper's Eq. 151 in
/// the references' closed form): (ga+1)(gb+1) (ta/tb)^(ta<tb ? gb : -ga) /
/// ((ga+gb+1) max(ta, tb)). Symmetric; invariant to the time unit up to a
/// common 1/T factor. Steps >= 1 and gammas > 0, else c10::ValueError.
double profileInnerProduct(int64_t stepA, double gammaA, int64_t stepB, double gammaB);

struct SynthesisOptions {
  /// false (default, ema-pytorch / nitrous / FastVideo): the raw square
  /// solve A w = b, whose weights sum to about 1. true (edm2): the weights
  /// are divided by their sum so they add up to exactly 1.
  bool normalize = false;
  /// Condition numbers (1-norm) above this set SynthesisWeights::
  /// badlyConditioned and emit a warning (detail::warn) naming the value.
  /// Default 1e12: float64 then keeps about 4 significant digits of the
  /// weights. Larger: fewer warnings, less accurate weights let through.
  double warnConditionAbove = 1e12;
};

struct SynthesisWeights {
  /// One weight per input snapshot, in input order; snapshots left out
  /// (t > target step) have weight 0 and used[i] == false.
  std::vector<double> weights;
  std::vector<bool> used;
  int64_t targetStep = 0;
  double targetGamma = 0.0;
  double targetSigmaRel = 0.0;
  /// 1-norm condition number of the Gram matrix of the used snapshots.
  double conditionNumber = 0.0;
  bool badlyConditioned = false;
  /// Sum of the weights (exactly 1 up to rounding when normalized).
  double sum = 0.0;
};

/// Solves for the weights that synthesize sigma_rel `targetSigmaRel` at step
/// `targetStep` (0 = the newest snapshot's step) from `snapshots`.
/// Snapshots with t > targetStep are left out (edm2 / FastVideo; in exact
/// arithmetic they would get weight 0 whenever snapshots sit at the target
/// step). Errors (c10::ValueError naming the parameter): targetSigmaRel
/// outside (0, 0.2887); targetStep negative or beyond the newest snapshot;
/// a snapshot with step < 1 or gamma <= 0; two snapshots with the same
/// (step, gamma) (their Gram matrix is singular); fewer than two distinct
/// snapshots left after the filter; a numerically singular system.
SynthesisWeights solveSynthesisWeights(const std::vector<SnapshotProfile>& snapshots,
                                       double targetSigmaRel, int64_t targetStep = 0,
                                       const SynthesisOptions& options = {});

}  // namespace shardema
