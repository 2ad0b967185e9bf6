// PostHocCallback in one process (rank 0 of 1, rank-0 full copy, pinned-host
// EMA): when snapshots appear, that they hold the nitrous power-function EMA
// (checked against a float64 recomputation from the weights the loop saw),
// the counting rules (startIter, accumulation, updateEvery), the end of
// training (final snapshot, raw synthesis into deployable weights). The
// option checks: posthoc_options_test.cpp.
#include "shardema/posthoc_callback.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "lib/posthoc_fixture.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/synthesis.h"
#include "support/value_error.h"

namespace shardema::posthoc_test {
namespace {

// fp32 EMA storage over ~10 lerps against the float64 reference.
constexpr double kEmaTolerance = 1e-6;

// Checks both profiles' snapshots at `step` against the float64 EMA of the
// run's counted values.
void expectSnapshotsMatchReference(const PostHocRun& run, const std::string& folder, int64_t step,
                                   int64_t updateEvery = 1) {
  const std::vector<double>& sigmas = run.callback().options().sigmaRels;
  for (size_t p = 0; p < sigmas.size(); ++p) {
    const std::string what = "profile " + std::to_string(p) + " step " + std::to_string(step);
    const TensorFile file =
        readTensorFile(folder + "/" + posthoc_test::snapshotName(static_cast<int64_t>(p), step));
    const Values expected = posthoc_test::referenceEma(run.counted, sigmas[p], step, updateEvery);
    for (const auto& [name, want] : expected) {
      ASSERT_TRUE(file.contains(name)) << what << ": no " << name;
      EXPECT_EQ(file.at(name).scalar_type(), at::kFloat) << what << " " << name;
      EXPECT_TRUE(posthoc_test::closeTo(file.at(name), want, kEmaTolerance, what + " " + name));
    }
    // kEmaPytorch copies integer buffers once, when the EMA is built: the
    // fresh module had not counted any batch yet.
    ASSERT_TRUE(file.contains("bn.num_batches_tracked")) << what;
    EXPECT_EQ(file.at("bn.num_batches_tracked").scalar_type(), at::kLong) << what;
    EXPECT_EQ(file.at("bn.num_batches_tracked").item<int64_t>(), 0) << what;
  }
}

TEST(PostHocCallbackTest, SnapshotsAppearExactlyAtCheckpointBoundaries) {
  TempDir dir;
  PostHocRun run(1, smallOptions(dir.path(), 4));
  run.fitStart();
  EXPECT_TRUE(run.callback().holdsEma());
  EXPECT_EQ(run.callback().snapshotFolder(), dir.path());
  std::vector<int64_t> boundaries;
  const auto checkFolder = [&] {
    const int64_t calls = run.callback().calls();
    if (calls % 4 == 0) boundaries.push_back(calls);
    // Written before onTrainBatchEnd returns, and only at the boundaries.
    EXPECT_EQ(posthoc_test::filesIn(dir.path()), posthoc_test::snapshotNames(boundaries))
        << "after call " << calls;
  };
  for (int64_t epoch = 0; epoch < 2; ++epoch) run.epoch(epoch, stepEveryBatch(5), checkFolder);
  EXPECT_EQ(run.callback().calls(), 10);
  EXPECT_EQ(boundaries, (std::vector<int64_t>{4, 8}));
  for (const int64_t step : boundaries) {
    for (int64_t p = 0; p < 2; ++p) {
      const SnapshotInfo info = readSnapshotInfo(dir.file(posthoc_test::snapshotName(p, step)));
      const double sigma = p == 0 ? 0.05 : 0.1;
      EXPECT_EQ(info.profileIndex, p);
      EXPECT_EQ(info.step, step);
      EXPECT_NEAR(info.sigmaRel, sigma, 1e-12);
      EXPECT_NEAR(info.gamma, sigmaRelToGamma(sigma), 1e-12 * info.gamma);
      EXPECT_FALSE(info.sharded());
    }
  }
}

TEST(PostHocCallbackTest, SnapshotsHoldTheNitrousPowerFunctionEma) {
  TempDir dir;
  PostHocRun run(2, smallOptions(dir.path(), 4));
  run.fit(3, 4);
  ASSERT_EQ(run.callback().calls(), 12);
  for (const int64_t step : {4, 8, 12}) expectSnapshotsMatchReference(run, dir.path(), step);
  // The EMA lags the weights: a snapshot that merely copied them would
  // pass the reference check only if the reference were wrong too.
  const TensorFile last = readTensorFile(dir.file("1.12.safetensors"));
  EXPECT_FALSE(posthoc_test::closeTo(last.at("fc1.weight"), run.counted.back().at("fc1.weight"),
                                     1e-4, "lag"));
}

TEST(PostHocCallbackTest, StepsBeforeStartIterAreNotCounted) {
  TempDir dir;
  PostHocCallbackOptions options = smallOptions(dir.path(), 4);
  options.startIter = 3;
  PostHocRun run(3, options);
  run.fitStart();
  const std::vector<int64_t> counted = run.epoch(0, stepEveryBatch(11));
  // Global steps 1..3 have 0-based indices 0..2 < startIter.
  EXPECT_EQ(counted, (std::vector<int64_t>{3, 4, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(run.callback().calls(), 8);
  // Snapshot steps are counted calls, not global steps.
  EXPECT_EQ(posthoc_test::filesIn(dir.path()), posthoc_test::snapshotNames({4, 8}));
  EXPECT_EQ(readSnapshotInfo(dir.file("0.4.safetensors")).step, 4);
  for (const int64_t step : {4, 8}) expectSnapshotsMatchReference(run, dir.path(), step);
}

TEST(PostHocCallbackTest, GradientAccumulationCountsOnlyWindowEnds) {
  TempDir dir;
  PostHocRun run(4, smallOptions(dir.path(), 3));
  run.fitStart();
  LoopShape shape = stepEveryBatch(10);
  shape.accumulate = 4;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    // Windows end after batches 3 and 7; batch 9 ends the epoch.
    EXPECT_EQ(run.epoch(epoch, shape), (std::vector<int64_t>{3, 7, 9})) << "epoch " << epoch;
  }
  EXPECT_EQ(run.callback().calls(), 6);
  EXPECT_EQ(posthoc_test::filesIn(dir.path()), posthoc_test::snapshotNames({3, 6}));
  for (const int64_t step : {3, 6}) expectSnapshotsMatchReference(run, dir.path(), step);
}

TEST(PostHocCallbackTest, UpdateEveryTwoUpdatesOnOddCallsWithCorrectedBeta) {
  TempDir dir;
  PostHocCallbackOptions options = smallOptions(dir.path(), 4);
  options.updateEvery = 2;
  PostHocRun run(5, options);
  run.fit(2, 4);
  // Every optimizer step counts; only calls 1, 3, 5, 7 update.
  EXPECT_EQ(run.callback().calls(), 8);
  for (const int64_t step : {4, 8}) expectSnapshotsMatchReference(run, dir.path(), step, 2);
}

TEST(PostHocCallbackTest, TrainEndWritesAFinalSnapshotAndTheRawSynthesis) {
  TempDir dir;
  TempDir out;
  PostHocRun run(6, smallOptions(dir.path(), 4, out.path()));
  run.fit(2, 5);
  ASSERT_EQ(run.callback().calls(), 10);
  const std::string path = run.callback().onTrainEnd();
  EXPECT_EQ(path, out.file("shardema_ema_final_sigma_0p05_step_000000010.safetensors"));
  // 10 is off the boundary: a final snapshot at 10 joins those at 4 and 8.
  EXPECT_EQ(posthoc_test::filesIn(dir.path()), posthoc_test::snapshotNames({4, 8, 10}));
  expectSnapshotsMatchReference(run, dir.path(), 10);

  const TensorFile deployable = readTensorFile(path);
  EXPECT_EQ(deployable.metadata.at("shardema.step"), "10");
  const Values expected =
      posthoc_test::referenceSynthesis(dir.path(), {0.05, 0.1}, {4, 8, 10}, 0.05, 10);
  posthoc_test::expectFileMatches(deployable, expected, 1e-6, "deployable");
  // The offline tool over the same folder gives the same weights.
  SnapshotSynthesisOptions offline;
  offline.sigmaRel = 0.05;
  synthesizeSnapshotFolder(dir.path(), out.file("offline.safetensors"), offline);
  const TensorFile merged = readTensorFile(out.file("offline.safetensors"));
  Values mergedValues(merged.tensors.begin(), merged.tensors.end());
  posthoc_test::expectFileMatches(deployable, mergedValues, 1e-6, "offline");
}

TEST(PostHocCallbackTest, TrainEndOnABoundaryDoesNotRewriteTheSnapshot) {
  TempDir dir;
  TempDir out;
  PostHocRun run(7, smallOptions(dir.path(), 4, out.path()));
  run.fit(2, 4);
  ASSERT_EQ(run.callback().calls(), 8);
  const auto before0 = posthoc_test::fileIdentity(dir.file("0.8.safetensors"));
  const auto before1 = posthoc_test::fileIdentity(dir.file("1.8.safetensors"));
  const std::string path = run.callback().onTrainEnd();
  EXPECT_EQ(path, out.file(PostHocCallback::deployableFileName("shardema_ema_final", 0.05, 8)));
  EXPECT_EQ(posthoc_test::filesIn(dir.path()), posthoc_test::snapshotNames({4, 8}));
  EXPECT_EQ(posthoc_test::fileIdentity(dir.file("0.8.safetensors")), before0);
  EXPECT_EQ(posthoc_test::fileIdentity(dir.file("1.8.safetensors")), before1);
  const TensorFile deployable = readTensorFile(path);
  EXPECT_EQ(deployable.metadata.at("shardema.step"), "8");
  posthoc_test::expectFileMatches(
      deployable, posthoc_test::referenceSynthesis(dir.path(), {0.05, 0.1}, {4, 8}, 0.05, 8), 1e-6,
      "deployable");
}

// The snapshot folder holds snapshots only (its scan refuses any other
// safetensors file), so by default the result lands beside it, and the
// folder still synthesizes offline afterwards.
TEST(PostHocCallbackTest, DeployableWeightsGoBesideTheSnapshotFolderByDefault) {
  TempDir dir;
  const std::string snapshots = dir.file("posthoc");
  PostHocCallbackOptions options = smallOptions(snapshots + "/", 3);
  options.outputPrefix = "run7";
  options.defaultOutputSigma = 0.1;
  PostHocRun run(8, options);
  run.fitStart();
  run.epoch(0, stepEveryBatch(5));
  const std::string path = run.callback().onTrainEnd();
  EXPECT_EQ(fs::path(path).lexically_normal(),
            fs::path(dir.file("run7_sigma_0p1_step_000000005.safetensors")).lexically_normal());
  EXPECT_TRUE(fs::is_regular_file(path));
  const Values expected = posthoc_test::referenceSynthesis(snapshots, {0.05, 0.1}, {3, 5}, 0.1, 5);
  posthoc_test::expectFileMatches(readTensorFile(path), expected, 1e-6, "deployable");
  SnapshotSynthesisOptions offline;
  offline.sigmaRel = 0.1;
  synthesizeSnapshotFolder(snapshots, dir.file("offline.safetensors"), offline);
  posthoc_test::expectFileMatches(readTensorFile(dir.file("offline.safetensors")), expected, 1e-6,
                                  "offline");
}

TEST(PostHocCallbackTest, Bfloat16OutputRoundsTheSynthesis) {
  TempDir dir;
  TempDir out;
  PostHocCallbackOptions options = smallOptions(dir.path(), 3, out.path());
  options.outputDtype = c10::ScalarType::BFloat16;
  PostHocRun run(9, options);
  run.fitStart();
  run.epoch(0, stepEveryBatch(6));
  const TensorFile deployable = readTensorFile(run.callback().onTrainEnd());
  const Values expected =
      posthoc_test::referenceSynthesis(dir.path(), {0.05, 0.1}, {3, 6}, 0.05, 6);
  for (const auto& [name, tensor] : deployable.tensors) {
    const bool floating = at::isFloatingType(expected.at(name).scalar_type());
    EXPECT_EQ(tensor.scalar_type(), floating ? at::kBFloat16 : at::kLong) << name;
  }
  // bfloat16 keeps 8 significant bits: half an ulp is 2^-9 relative.
  posthoc_test::expectFileMatches(deployable, expected, 1.0 / 256, "bf16");
}

TEST(PostHocCallbackTest, TrainEndWithoutCountedCallsWritesNothing) {
  TempDir dir;
  PostHocCallbackOptions options = smallOptions(dir.path(), 3);
  options.startIter = 100;
  PostHocRun run(10, options);
  run.fit(1, 3);
  EXPECT_EQ(run.callback().calls(), 0);
  EXPECT_EQ(run.callback().onTrainEnd(), "");
  EXPECT_TRUE(posthoc_test::filesIn(dir.path()).empty());
}

// A tensor with no elements (an FSDP2 rank's share of a tensor with fewer
// rows than ranks looks the same) must not trip the multi-profile update.
TEST(PostHocCallbackTest, ZeroElementTensorsAreTrackedByEveryProfile) {
  struct WithEmpty : torch::nn::Module {
    WithEmpty() {
      w = register_parameter("w", torch::zeros({3}));
      empty = register_parameter("empty", torch::zeros({0}));
    }
    torch::Tensor w, empty;
  };
  TempDir dir;
  WithEmpty module;
  PostHocCallback callback(smallOptions(dir.path(), 2));
  callback.onFitStart(module);
  std::vector<Values> counted;
  for (int64_t step = 1; step <= 2; ++step) {
    callback.onBeforeOptimizerStep();
    {
      torch::NoGradGuard noGrad;
      module.w.fill_(static_cast<double>(step));
    }
    counted.push_back(posthoc_test::floatingValues(module));
    EXPECT_TRUE(callback.onTrainBatchEnd(step, 0, 1, true)) << step;
  }
  for (int64_t p = 0; p < 2; ++p) {
    const TensorFile file = readTensorFile(dir.file(posthoc_test::snapshotName(p, 2)));
    EXPECT_EQ(file.at("empty").numel(), 0);
    EXPECT_TRUE(posthoc_test::closeTo(
        file.at("w"), posthoc_test::referenceEma(counted, p == 0 ? 0.05 : 0.1, 2).at("w"),
        kEmaTolerance, "w"));
  }
}

TEST(PostHocCallbackTest, DeployableFileNamePrintsSigmaAsPython) {
  EXPECT_EQ(PostHocCallback::deployableFileName("p", 0.05, 12345),
            "p_sigma_0p05_step_000012345.safetensors");
  EXPECT_EQ(PostHocCallback::deployableFileName("p", 0.1, 12345),
            "p_sigma_0p1_step_000012345.safetensors");
  EXPECT_EQ(PostHocCallback::deployableFileName("mmaudio_ema_final", 0.15, 5000),
            "mmaudio_ema_final_sigma_0p15_step_000005000.safetensors");
}

// Each test below breaks one option of these valid ones.
// The header promises the communicator is needed for the collective hooks
// when worldSize > 1; whether the constructor or the hook refuses is left
// open, so the whole lifecycle up to the gather must refuse it.
TEST(PostHocCallbackTest, ShardedWorldWithoutACommunicatorIsRefused) {
  TempDir dir;
  PostHocCallbackOptions options = smallOptions(dir.path(), 2);
  options.layout = PostHocLayout::kSharded;
  EXPECT_THROW(
      {
        PostHocRun run(11, options, PostHocRanks{0, 2, nullptr});
        run.fitStart();
        run.epoch(0, stepEveryBatch(2));
        run.callback().onTrainEnd();
      },
      c10::ValueError);
}

// A fresh run in a folder that holds another run's snapshots would
// synthesize from both; it is refused at its first call, nothing deleted.
TEST(PostHocCallbackTest, AFreshRunRefusesAFolderWithAnotherRunsSnapshots) {
  TempDir dir;
  TempDir out;
  {
    PostHocRun first(12, smallOptions(dir.path(), 2, out.path()));
    first.fitStart();
    first.epoch(0, stepEveryBatch(2));
  }
  PostHocRun second(13, smallOptions(dir.path(), 2, out.path()));
  second.fitStart();
  EXPECT_VALUE_ERROR(second.epoch(0, stepEveryBatch(2)), "already holds snapshots");
  EXPECT_EQ(posthoc_test::filesIn(dir.path()), posthoc_test::snapshotNames({2}));
}

TEST(PostHocCallbackTest, RejectsAnOutputFolderThatIsTheSnapshotFolder) {
  TempDir dir;
  PostHocCallbackOptions options = smallOptions(dir.path(), 4);
  options.outputFolder = dir.path() + "/";
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "snapshots only");
  options.outputFolder = "";
  options.checkpointFolder = ".";  // its parent is "." too
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "snapshots only");
}

}  // namespace
}  // namespace shardema::posthoc_test
