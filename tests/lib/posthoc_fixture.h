#pragma once
// Shared by the PostHocCallback tests: a TestNet whose weights are a pure
// function of a seed (no RNG, so ranks on threads build identical
// replicas), a training loop that drives the callback's hooks in a
// trainer's order and records what every counted step left in the module,
// and the float64 references the callback's files are checked against:
// the nitrous power-function EMA (docs/spec/reference_semantics.md section 2) and the raw post-hoc
// synthesis (docs/spec/reference_semantics.md section 3), written out here independently of the
// library's Averager and file synthesis.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/posthoc_synthesis.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "shardema/module_tracking.h"
#include "shardema/posthoc_callback.h"
#include "support/temp_dir.h"
#include "support/test_net.h"
#include "support/training_loop.h"

namespace shardema::posthoc_test {

namespace fs = std::filesystem;

using testing::LoopShape;
using testing::TempDir;
using testing::TestNet;
using Values = std::map<std::string, at::Tensor>;

/// `batches` batches per epoch with an optimizer step after each one.
inline LoopShape stepEveryBatch(int64_t batches) {
  LoopShape shape;
  shape.batchesPerEpoch = batches;
  shape.accumulate = 1;
  shape.batchSize = 8;
  return shape;
}

/// A TestNet whose parameters are sines of (seed, tensor, element); the
/// frozen parameter keeps its ones and the buffers their initial values.
inline TestNet deterministicNet(int64_t seed) {
  TestNet net;
  torch::NoGradGuard noGrad;
  int64_t index = 0;
  for (auto& item : net->named_parameters()) {
    ++index;
    if (item.key() == "frozen") continue;
    at::Tensor& p = item.value();
    const at::Tensor values =
        at::sin(at::arange(p.numel(), at::kDouble) * 0.37 + 1.3 * seed + 0.71 * index) * 0.5;
    p.copy_(values.reshape(p.sizes()));
  }
  return net;
}

/// Float64 clones of the module's floating parameters and buffers (what
/// kEmaPytorch averages), by name.
inline Values floatingValues(const torch::nn::Module& module) {
  Values values;
  for (const auto& [name, tensor] : moduleTensors(module)) {
    if (at::isFloatingType(tensor.scalar_type())) {
      values[name] = tensor.detach().to(at::kDouble).clone();
    }
  }
  return values;
}

/// One replica and its callback, trained on batchData like a trainer would.
struct PostHocRun {
  PostHocRun(int64_t seed, PostHocCallbackOptions options, PostHocRanks ranks = {})
      : net(deterministicNet(seed)),
        sgd(net->parameters(), torch::optim::SGDOptions(0.05)),
        callback_(std::make_unique<PostHocCallback>(std::move(options), ranks)) {}

  PostHocCallback& callback() { return *callback_; }
  const PostHocCallback& callback() const { return *callback_; }
  void fitStart() { callback_->onFitStart(*net); }
  /// fitStart, then `epochs` epochs of `batches` batches, a step each.
  void fit(int64_t epochs, int64_t batches) {
    fitStart();
    for (int64_t e = 0; e < epochs; ++e) epoch(e, stepEveryBatch(batches));
  }
  /// A fresh callback on the same module and optimizer (what a resumed
  /// job builds); the old one is destroyed first.
  void replaceCallback(PostHocCallbackOptions options, PostHocRanks ranks = {}) {
    callback_.reset();
    callback_ = std::make_unique<PostHocCallback>(std::move(options), ranks);
  }

  /// One epoch of the loop: forward/backward per batch, and at the end of
  /// an accumulation window (or the epoch) onBeforeOptimizerStep, the step
  /// and onTrainBatchEnd. The module's floating values at every counted
  /// call go to `counted` (index = calls - 1), and `afterCounted` runs
  /// after each. Returns the batch indices whose call was counted.
  std::vector<int64_t> epoch(int64_t index, const LoopShape& shape,
                             const std::function<void()>& afterCounted = {}) {
    std::vector<int64_t> countedAfterBatch;
    net->train();
    for (int64_t b = 0; b < shape.batchesPerEpoch; ++b) {
      const auto [x, y] = testing::batchData(index, b, shape.batchSize);
      torch::Tensor loss = torch::nn::functional::mse_loss(net->forward(x), y) / shape.accumulate;
      loss.backward();
      const bool isLast = b == shape.batchesPerEpoch - 1;
      if ((b + 1) % shape.accumulate == 0 || isLast) {
        callback_->onBeforeOptimizerStep();
        sgd.step();
        sgd.zero_grad();
        ++globalStep;
      }
      // What an update at this call reads: the weights after the step and
      // the buffers after this batch's forward.
      Values now = floatingValues(*net);
      if (callback_->onTrainBatchEnd(globalStep, b, shape.accumulate, isLast)) {
        counted.push_back(std::move(now));
        countedAfterBatch.push_back(b);
        if (afterCounted) afterCounted();
      }
    }
    return countedAfterBatch;
  }

  TestNet net;
  torch::optim::SGD sgd;
  int64_t globalStep = 0;
  std::vector<Values> counted;

 private:
  std::unique_ptr<PostHocCallback> callback_;
};

/// Options most tests share: two profiles, a small checkpointEvery.
inline PostHocCallbackOptions smallOptions(const std::string& folder, int64_t checkpointEvery,
                                           const std::string& outputFolder = "") {
  PostHocCallbackOptions options;
  options.sigmaRels = {0.05, 0.1};
  options.checkpointEvery = checkpointEvery;
  options.checkpointFolder = folder;
  options.outputFolder = outputFolder;
  return options;
}

/// nitrous's plain beta at step s: (1 - 1/(s+1))^(gamma+1).
inline double nitrousBeta(double gamma, int64_t s) {
  return std::pow(1.0 - 1.0 / static_cast<double>(s + 1), gamma + 1.0);
}

/// The nitrous power-function EMA of one profile after `calls` counted
/// calls, in float64: due calls n with (n-1) % u == 0, the first one a
/// copy, then beta = [b(n) b(n+u)]^(u/2) (step_size_correction).
inline Values referenceEma(const std::vector<Values>& counted, double sigmaRel, int64_t calls,
                           int64_t updateEvery = 1) {
  const double gamma = sigmaRelToGamma(sigmaRel);
  Values ema;
  for (int64_t n = 1; n <= calls; ++n) {
    if ((n - 1) % updateEvery != 0) continue;
    const Values& x = counted.at(static_cast<size_t>(n - 1));
    if (ema.empty()) {
      for (const auto& [name, value] : x) ema[name] = value.clone();
      continue;
    }
    const double u = static_cast<double>(updateEvery);
    const double beta =
        std::pow(nitrousBeta(gamma, n) * nitrousBeta(gamma, n + updateEvery), u / 2.0);
    for (auto& [name, value] : ema) value = beta * value + (1.0 - beta) * x.at(name);
  }
  return ema;
}

/// Whether |actual - expected| <= tolerance * max(1, |expected|) everywhere
/// (fp32 rounding of O(1) weights is about 6e-8 per operation).
inline ::testing::AssertionResult closeTo(const at::Tensor& actual, const at::Tensor& expected,
                                          double tolerance, const std::string& what) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << what << ": shape " << actual.sizes() << " vs " << expected.sizes();
  }
  const at::Tensor a = actual.to(at::kDouble);
  const at::Tensor e = expected.to(at::kDouble);
  const at::Tensor scaled = (a - e).abs() / e.abs().clamp_min(1.0);
  const double worst = scaled.numel() == 0 ? 0.0 : scaled.max().item<double>();
  if (worst <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": scaled difference " << worst << " > " << tolerance;
}

/// "{i}.{step}.safetensors", written out here rather than taken from the
/// library.
inline std::string snapshotName(int64_t profile, int64_t step) {
  return std::to_string(profile) + "." + std::to_string(step) + ".safetensors";
}

/// The names of the regular files directly in `folder` (sorted).
inline std::set<std::string> filesIn(const std::string& folder) {
  std::set<std::string> names;
  std::error_code ignored;
  if (!fs::is_directory(folder, ignored)) return names;
  for (const auto& item : fs::directory_iterator(folder))
    names.insert(item.path().filename().string());
  return names;
}

/// The snapshot names of two profiles at every step in `steps`.
inline std::set<std::string> snapshotNames(const std::vector<int64_t>& steps) {
  std::set<std::string> names;
  for (const int64_t step : steps) {
    names.insert(snapshotName(0, step));
    names.insert(snapshotName(1, step));
  }
  return names;
}

/// The raw post-hoc synthesis (docs/spec/reference_semantics.md section 3) of `sigmaRel` at `step`
/// from the full-copy snapshots of `folder` for the given profiles and steps: weights from
/// solveSynthesisWeights over (step, gamma of sigmaRels[i]), tensors read with readTensorFile and
/// summed in float64. Integer tensors come from the newest snapshot.
inline Values referenceSynthesis(const std::string& folder, const std::vector<double>& sigmaRels,
                                 const std::vector<int64_t>& steps, double sigmaRel, int64_t step) {
  std::vector<SnapshotProfile> profiles;
  std::vector<std::string> paths;
  for (const int64_t t : steps) {
    for (size_t i = 0; i < sigmaRels.size(); ++i) {
      profiles.push_back({t, sigmaRelToGamma(sigmaRels[i])});
      paths.push_back(folder + "/" + snapshotName(static_cast<int64_t>(i), t));
    }
  }
  const SynthesisWeights weights = solveSynthesisWeights(profiles, sigmaRel, step);
  Values sum;
  int64_t newest = -1;
  for (size_t k = 0; k < paths.size(); ++k) {
    if (!weights.used[k]) continue;
    const TensorFile file = readTensorFile(paths[k]);
    const bool newer = profiles[k].step > newest;
    newest = std::max(newest, profiles[k].step);
    for (const auto& [name, tensor] : file.tensors) {
      if (!at::isFloatingType(tensor.scalar_type())) {
        if (newer || !sum.count(name)) sum[name] = tensor.clone();
        continue;
      }
      const at::Tensor term = tensor.to(at::kDouble) * weights.weights[k];
      sum[name] = sum.count(name) ? sum[name] + term : term;
    }
  }
  return sum;
}

/// Checks every tensor of `file` against `expected` (same names) within
/// `tolerance`; integer tensors must be equal.
inline void expectFileMatches(const TensorFile& file, const Values& expected, double tolerance,
                              const std::string& what) {
  std::set<std::string> names;
  for (const auto& [name, tensor] : file.tensors) {
    names.insert(name);
    ASSERT_TRUE(expected.count(name)) << what << ": unexpected tensor " << name;
    const at::Tensor& want = expected.at(name);
    if (at::isFloatingType(want.scalar_type())) {
      EXPECT_TRUE(closeTo(tensor, want, tolerance, what + " " + name));
    } else {
      EXPECT_EQ(tensor.scalar_type(), want.scalar_type()) << what << " " << name;
      EXPECT_TRUE(tensor.equal(want)) << what << " " << name;
    }
  }
  EXPECT_EQ(names.size(), expected.size()) << what << ": tensors missing from the file";
}

/// Inode and modification time: a crash-safe rewrite (temp file + rename)
/// changes the inode even when the bytes come out the same.
inline std::pair<ino_t, int64_t> fileIdentity(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return {0, -1};
  return {info.st_ino,
          static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 + info.st_mtim.tv_nsec};
}

}  // namespace shardema::posthoc_test
