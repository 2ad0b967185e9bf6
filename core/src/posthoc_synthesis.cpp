#include "shardema/core/posthoc_synthesis.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <sstream>
#include <utility>

#include "shardema/core/power_function.h"
#include "shardema/core/warning.h"

namespace shardema {
namespace {

// The Gram matrix is symmetric positive definite in exact arithmetic, but
// with many snapshots it is close to singular, so a pivoting LU (what
// torch.linalg.solve and np.linalg.solve run, LAPACK gesv) rather than a
// Cholesky that could fail on rounding: the weights then agree with the
// references to about cond(A) * eps.
class LuFactors {
 public:
  explicit LuFactors(std::vector<double> matrix, size_t n)
      : lu_(std::move(matrix)), n_(n), pivot_(n) {
    for (size_t k = 0; k < n_; ++k) {
      size_t best = k;
      for (size_t i = k + 1; i < n_; ++i) {
        if (std::fabs(at(i, k)) > std::fabs(at(best, k))) best = i;
      }
      pivot_[k] = best;
      if (best != k) {
        for (size_t j = 0; j < n_; ++j) std::swap(at(k, j), at(best, j));
      }
      const double diagonal = at(k, k);
      if (diagonal == 0.0 || !std::isfinite(diagonal)) {
        singular_ = true;
        return;
      }
      for (size_t i = k + 1; i < n_; ++i) {
        const double factor = at(i, k) / diagonal;
        at(i, k) = factor;
        for (size_t j = k + 1; j < n_; ++j) at(i, j) -= factor * at(k, j);
      }
    }
  }

  bool singular() const { return singular_; }

  std::vector<double> solve(std::vector<double> rhs) const {
    for (size_t k = 0; k < n_; ++k) std::swap(rhs[k], rhs[pivot_[k]]);
    for (size_t i = 0; i < n_; ++i) {
      for (size_t j = 0; j < i; ++j) rhs[i] -= at(i, j) * rhs[j];
    }
    for (size_t i = n_; i-- > 0;) {
      for (size_t j = i + 1; j < n_; ++j) rhs[i] -= at(i, j) * rhs[j];
      rhs[i] /= at(i, i);
    }
    return rhs;
  }

 private:
  double& at(size_t i, size_t j) { return lu_[i * n_ + j]; }
  double at(size_t i, size_t j) const { return lu_[i * n_ + j]; }

  std::vector<double> lu_;
  size_t n_;
  std::vector<size_t> pivot_;
  bool singular_ = false;
};

double oneNorm(const std::vector<double>& matrix, size_t n) {
  double best = 0.0;
  for (size_t j = 0; j < n; ++j) {
    double column = 0.0;
    for (size_t i = 0; i < n; ++i) column += std::fabs(matrix[i * n + j]);
    best = std::max(best, column);
  }
  return best;
}

// ||A||_1 ||A^-1||_1 with the inverse formed column by column: the systems
// are small (one row per snapshot), so the exact value is affordable and
// clearer to report than an estimate.
double conditionNumber(const std::vector<double>& matrix, const LuFactors& lu, size_t n) {
  std::vector<double> inverse(n * n);
  for (size_t j = 0; j < n; ++j) {
    std::vector<double> unit(n, 0.0);
    unit[j] = 1.0;
    const std::vector<double> column = lu.solve(std::move(unit));
    for (size_t i = 0; i < n; ++i) inverse[i * n + j] = column[i];
  }
  return oneNorm(matrix, n) * oneNorm(inverse, n);
}

void checkProfile(const char* what, int64_t step, double gamma) {
  TORCH_CHECK_VALUE(step >= 1, "profileInnerProduct: ", what, " step (", step,
                    ") must be >= 1 (snapshots are taken after optimizer steps)");
  TORCH_CHECK_VALUE(std::isfinite(gamma) && gamma > 0.0, "profileInnerProduct: ", what, " gamma (",
                    gamma, ") must be finite and > 0");
}

bool sameGamma(double a, double b) { return std::fabs(a - b) <= 1e-12 * std::max(a, b); }

}  // namespace

double profileInnerProduct(int64_t stepA, double gammaA, int64_t stepB, double gammaB) {
  checkProfile("first", stepA, gammaA);
  checkProfile("second", stepB, gammaB);
  const double ta = static_cast<double>(stepA);
  const double tb = static_cast<double>(stepB);
  const double exponent = ta < tb ? gammaB : -gammaA;
  const double numerator = (gammaA + 1.0) * (gammaB + 1.0) * std::pow(ta / tb, exponent);
  return numerator / ((gammaA + gammaB + 1.0) * std::max(ta, tb));
}

namespace {

// The checks on the inputs; returns the newest snapshot's step.
int64_t checkSynthesisInputs(const std::vector<SnapshotProfile>& snapshots, double targetSigmaRel,
                             int64_t targetStep) {
  TORCH_CHECK_VALUE(targetSigmaRel > 0.0 && targetSigmaRel < kMaxSigmaRel,
                    "solveSynthesisWeights: target sigma_rel (", targetSigmaRel,
                    ") must lie in (0, 0.2887); larger values have no power profile");
  TORCH_CHECK_VALUE(targetStep >= 0, "solveSynthesisWeights: target step (", targetStep,
                    ") must be >= 1, or 0 for the newest snapshot");
  TORCH_CHECK_VALUE(!snapshots.empty(),
                    "solveSynthesisWeights: no snapshots; synthesis needs at least two");
  int64_t newest = 0;
  for (size_t i = 0; i < snapshots.size(); ++i) {
    const SnapshotProfile& s = snapshots[i];
    TORCH_CHECK_VALUE(s.step >= 1, "solveSynthesisWeights: snapshot ", i, " has step ", s.step,
                      "; steps are >= 1");
    TORCH_CHECK_VALUE(std::isfinite(s.gamma) && s.gamma > 0.0, "solveSynthesisWeights: snapshot ",
                      i, " has gamma ", s.gamma, "; gamma must be finite and > 0");
    newest = std::max(newest, s.step);
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(!(snapshots[j].step == s.step && sameGamma(snapshots[j].gamma, s.gamma)),
                        "solveSynthesisWeights: snapshots ", j, " and ", i,
                        " have the same (step, gamma) = (", s.step, ", ", s.gamma,
                        "); their profiles are identical and the system is singular");
    }
  }
  TORCH_CHECK_VALUE(targetStep <= newest, "solveSynthesisWeights: target step (", targetStep,
                    ") is beyond the newest snapshot (step ", newest,
                    "); the profile after it was never saved");
  return newest;
}

// Marks result.used and returns the indices of the snapshots at or before
// the target step (at least two).
std::vector<size_t> selectUsedSnapshots(const std::vector<SnapshotProfile>& snapshots,
                                        SynthesisWeights& result) {
  std::vector<size_t> usedIndex;
  result.used.assign(snapshots.size(), false);
  for (size_t i = 0; i < snapshots.size(); ++i) {
    if (snapshots[i].step <= result.targetStep) {
      usedIndex.push_back(i);
      result.used[i] = true;
    }
  }
  TORCH_CHECK_VALUE(usedIndex.size() >= 2, "solveSynthesisWeights: only ", usedIndex.size(),
                    " snapshot(s) at or before step ", result.targetStep,
                    "; synthesis needs at least two distinct snapshots");
  return usedIndex;
}

// Solves Gram x = rhs over the used snapshots (the least-squares fit of
// the target profile) and records the Gram matrix's condition number.
std::vector<double> solveGramSystem(const std::vector<SnapshotProfile>& snapshots,
                                    const std::vector<size_t>& usedIndex,
                                    SynthesisWeights& result) {
  const size_t n = usedIndex.size();
  std::vector<double> gram(n * n);
  std::vector<double> rhs(n);
  for (size_t i = 0; i < n; ++i) {
    const SnapshotProfile& a = snapshots[usedIndex[i]];
    for (size_t j = 0; j < n; ++j) {
      const SnapshotProfile& b = snapshots[usedIndex[j]];
      gram[i * n + j] = profileInnerProduct(a.step, a.gamma, b.step, b.gamma);
    }
    rhs[i] = profileInnerProduct(a.step, a.gamma, result.targetStep, result.targetGamma);
  }
  const LuFactors lu(gram, n);
  TORCH_CHECK_VALUE(!lu.singular(), "solveSynthesisWeights: the Gram matrix of the ", n,
                    " snapshots is singular; snapshots too close in (step, gamma)?");
  result.conditionNumber = conditionNumber(gram, lu, n);
  return lu.solve(rhs);
}

void warnIfBadlyConditioned(const SynthesisWeights& result, size_t numUsed) {
  if (!result.badlyConditioned) return;
  std::ostringstream message;
  message << "shardema: post-hoc synthesis of sigma_rel " << result.targetSigmaRel << " at step "
          << result.targetStep << " is badly conditioned (condition number "
          << result.conditionNumber << " over " << numUsed
          << " snapshots); the weights may be inaccurate: use fewer, more distinct snapshots";
  detail::warn(message.str());
}

double sumOf(const std::vector<double>& values) {
  double sum = 0.0;
  for (double v : values) sum += v;
  return sum;
}

}  // namespace

SynthesisWeights solveSynthesisWeights(const std::vector<SnapshotProfile>& snapshots,
                                       double targetSigmaRel, int64_t targetStep,
                                       const SynthesisOptions& options) {
  const int64_t newest = checkSynthesisInputs(snapshots, targetSigmaRel, targetStep);
  SynthesisWeights result;
  result.targetStep = targetStep == 0 ? newest : targetStep;
  result.targetSigmaRel = targetSigmaRel;
  result.targetGamma = sigmaRelToGamma(targetSigmaRel);
  const std::vector<size_t> usedIndex = selectUsedSnapshots(snapshots, result);
  std::vector<double> solved = solveGramSystem(snapshots, usedIndex, result);
  result.badlyConditioned = !(result.conditionNumber <= options.warnConditionAbove);
  warnIfBadlyConditioned(result, usedIndex.size());
  double sum = sumOf(solved);
  if (options.normalize) {
    TORCH_CHECK_VALUE(std::isfinite(sum) && sum != 0.0,
                      "solveSynthesisWeights: cannot normalize weights that sum to ", sum);
    for (double& w : solved) w /= sum;
    sum = sumOf(solved);
  }
  result.weights.assign(snapshots.size(), 0.0);
  for (size_t i = 0; i < usedIndex.size(); ++i) result.weights[usedIndex[i]] = solved[i];
  result.sum = sum;
  return result;
}

}  // namespace shardema
