// PostHocCallback resume and validation swap, one process: the training
// checkpoint holds only the call count, the EMAs come back from the
// snapshots on disk (FastVideo's DDPPostHocEMACallback), so a resume must
// land on a snapshot step; the validation swap puts the synthesis at the
// newest snapshot into the module and takes it out again.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>

#include "lib/posthoc_fixture.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/posthoc_callback.h"
#include "shardema/synthesis.h"
#include "shardema/training_checkpoint.h"
#include "support/value_error.h"

namespace shardema::posthoc_test {
namespace {

constexpr int64_t kSeed = 20;

// Bitwise: same names, dtypes and bytes.
void expectSameFile(const std::string& expectedPath, const std::string& actualPath) {
  const TensorFile expected = readTensorFile(expectedPath);
  const TensorFile actual = readTensorFile(actualPath);
  ASSERT_EQ(actual.tensors.size(), expected.tensors.size()) << actualPath;
  for (size_t i = 0; i < expected.tensors.size(); ++i) {
    const auto& [name, want] = expected.tensors[i];
    EXPECT_EQ(actual.tensors[i].first, name) << actualPath;
    EXPECT_EQ(actual.tensors[i].second.scalar_type(), want.scalar_type()) << name;
    EXPECT_TRUE(actual.tensors[i].second.equal(want)) << actualPath << " " << name;
  }
}

// The uninterrupted reference: 12 calls, snapshots at 4, 8, 12.
void trainTwelveSteps(const std::string& folder) {
  PostHocRun run(kSeed, smallOptions(folder, 4));
  run.fit(3, 4);
  ASSERT_EQ(run.callback().calls(), 12);
}

// Calls saved by the first 8 steps of the same run.
TrainingCheckpoint saveAfterEightSteps(PostHocRun& run) {
  run.fit(2, 4);
  TrainingCheckpoint checkpoint = TrainingCheckpoint::capture(*run.net);
  run.callback().onSaveCheckpoint(checkpoint);
  return checkpoint;
}

TEST(PostHocResumeTest, SaveCheckpointRecordsTheCalls) {
  TempDir dir;
  PostHocRun run(kSeed, smallOptions(dir.path(), 4));
  const TrainingCheckpoint checkpoint = saveAfterEightSteps(run);
  EXPECT_EQ(checkpoint.metadata.at("shardema.posthoc.calls"), "8");
}

TEST(PostHocResumeTest, LoadBeforeFitStartContinuesBitForBit) {
  TempDir straight;
  TempDir resumed;
  TempDir checkpoints;
  trainTwelveSteps(straight.path());
  PostHocRun run(kSeed, smallOptions(resumed.path(), 4));
  // Through a file, as a resumed job reads it.
  saveAfterEightSteps(run).save(checkpoints.file("train.safetensors"));
  run.replaceCallback(smallOptions(resumed.path(), 4));
  run.callback().onLoadCheckpoint(TrainingCheckpoint::load(checkpoints.file("train.safetensors")));
  // The module keeps its raw weights (plain SGD has no state to restore);
  // its integer buffer has counted 8 batches, but the EMA's copy of it
  // must come from the snapshot.
  run.fitStart();
  EXPECT_EQ(run.callback().calls(), 8);
  run.epoch(2, stepEveryBatch(4));
  EXPECT_EQ(run.callback().calls(), 12);
  for (const char* name : {"0.12.safetensors", "1.12.safetensors"}) {
    expectSameFile(straight.file(name), resumed.file(name));
  }
}

TEST(PostHocResumeTest, LoadAfterFitStartReloadsAtOnce) {
  TempDir straight;
  TempDir resumed;
  trainTwelveSteps(straight.path());
  PostHocRun run(kSeed, smallOptions(resumed.path(), 4));
  const TrainingCheckpoint checkpoint = saveAfterEightSteps(run);
  run.replaceCallback(smallOptions(resumed.path(), 4));
  run.fitStart();
  EXPECT_EQ(run.callback().calls(), 0);
  run.callback().onLoadCheckpoint(checkpoint);
  EXPECT_EQ(run.callback().calls(), 8);
  run.epoch(2, stepEveryBatch(4));
  for (const char* name : {"0.12.safetensors", "1.12.safetensors"}) {
    expectSameFile(straight.file(name), resumed.file(name));
  }
}

// Loads `checkpoint` into a fresh callback of `options` and starts it;
// returns the c10::ValueError message (or a marker that fails the checks).
std::string resumeError(PostHocRun& run, const PostHocCallbackOptions& options,
                        const TrainingCheckpoint& checkpoint) {
  run.replaceCallback(options);
  return testing::valueErrorMessage([&] {
    run.callback().onLoadCheckpoint(checkpoint);
    run.fitStart();
  });
}

// A checkpoint between snapshot steps (call 6, snapshots every 4) writes a
// resume state of the profiles; a resume from it goes on bit for bit as
// the uninterrupted run (12 calls, two epochs of 6).
TEST(PostHocResumeTest, ResumeBetweenSnapshotStepsGoesOnBitForBit) {
  TempDir straight;
  TempDir resumed;
  {
    PostHocRun run(kSeed, smallOptions(straight.path(), 4));
    run.fit(2, 6);
    ASSERT_EQ(run.callback().calls(), 12);
  }
  PostHocRun run(kSeed, smallOptions(resumed.path(), 4));
  run.fitStart();
  run.epoch(0, stepEveryBatch(6));
  TrainingCheckpoint checkpoint;
  run.callback().onSaveCheckpoint(checkpoint);
  ASSERT_EQ(checkpoint.metadata.at("shardema.posthoc.calls"), "6");
  EXPECT_TRUE(std::filesystem::exists(run.callback().resumeFolder() + "/0.6.safetensors"));
  run.replaceCallback(smallOptions(resumed.path(), 4));
  run.callback().onLoadCheckpoint(checkpoint);
  run.fitStart();
  EXPECT_EQ(run.callback().calls(), 6);
  run.epoch(1, stepEveryBatch(6));
  for (const char* name : {"0.8.safetensors", "1.8.safetensors", "0.12.safetensors",
                           "1.12.safetensors"}) {
    expectSameFile(straight.file(name), resumed.file(name));
  }
}

// Neither a snapshot nor a resume state at the saved call: the error names
// the file it looked for.
TEST(PostHocResumeTest, ResumeWithoutItsResumeStateNamesTheMissingFile) {
  TempDir dir;
  PostHocRun run(kSeed, smallOptions(dir.path(), 4));
  run.fitStart();
  run.epoch(0, stepEveryBatch(6));
  TrainingCheckpoint checkpoint;
  run.callback().onSaveCheckpoint(checkpoint);
  shardema::testing::removeTree(run.callback().resumeFolder());
  const std::string message = resumeError(run, smallOptions(dir.path(), 4), checkpoint);
  EXPECT_NE(message.find(".6.safetensors"), std::string::npos) << message;
}

TEST(PostHocResumeTest, ResumeWithADeletedSnapshotNamesIt) {
  TempDir dir;
  PostHocRun run(kSeed, smallOptions(dir.path(), 4));
  const TrainingCheckpoint checkpoint = saveAfterEightSteps(run);
  fs::remove(dir.file("1.8.safetensors"));
  const std::string message = resumeError(run, smallOptions(dir.path(), 4), checkpoint);
  EXPECT_NE(message.find("1.8.safetensors"), std::string::npos) << message;
}

TEST(PostHocResumeTest, ResumeWithOtherSigmaRelsNamesTheMismatchedFile) {
  TempDir dir;
  PostHocRun run(kSeed, smallOptions(dir.path(), 4));
  const TrainingCheckpoint checkpoint = saveAfterEightSteps(run);
  PostHocCallbackOptions other = smallOptions(dir.path(), 4);
  other.sigmaRels = {0.05, 0.15};
  const std::string message = resumeError(run, other, checkpoint);
  EXPECT_NE(message.find("1.8.safetensors"), std::string::npos) << message;
}

// --- Extending a finished run ---------------------------------------------
// A run of 6 calls (snapshots every 4) that finished (onTrainEnd's final
// snapshot at 6, off the grid), then extended to 12 from its checkpoint of
// 6, must hold and synthesize what the uninterrupted 12-call run does.

// Bitwise equal files: the same snapshots (and file set) and synthesis.
void expectSameSnapshotsAndSynthesis(const std::string& straight, const std::string& extended,
                                     const std::string& scratch) {
  std::set<std::string> snapshots;
  for (const std::string& name : filesIn(extended)) {
    if (name != "resume" && name != "superseded") snapshots.insert(name);
  }
  EXPECT_EQ(snapshots, snapshotNames({4, 8, 12}));
  EXPECT_EQ(filesIn(straight), snapshotNames({4, 8, 12}));
  for (const std::string& name : snapshotNames({4, 8, 12})) {
    expectSameFile(straight + "/" + name, extended + "/" + name);
  }
  // 0.07 is no profile's sigma_rel: every snapshot takes part in the solve.
  SnapshotSynthesisOptions options;
  options.sigmaRel = 0.07;
  synthesizeSnapshotFolder(straight, scratch + "/straight.safetensors", options);
  synthesizeSnapshotFolder(extended, scratch + "/extended.safetensors", options);
  expectSameFile(scratch + "/straight.safetensors", scratch + "/extended.safetensors");
}

// The uninterrupted run: 12 calls, snapshots at 4, 8, 12; its deployable
// weights go to `output`.
std::string straightTwelveCalls(const std::string& folder, const std::string& output) {
  PostHocRun run(kSeed, smallOptions(folder, 4, output));
  run.fit(2, 6);
  return run.callback().onTrainEnd();
}

// Lightning's order: the last checkpoint (call 6, between snapshots: it
// writes the resume state of 6), then the end of training (the final
// snapshot of 6). The extension resumes from that checkpoint.
TEST(PostHocResumeTest, ExtendingAFinishedRunSynthesizesWhatTheUninterruptedRunDoes) {
  TempDir straight, extended, outputs, scratch;
  const std::string straightWeights = straightTwelveCalls(straight.path(), outputs.file("a"));
  PostHocRun run(kSeed, smallOptions(extended.path(), 4, outputs.file("b")));
  run.fit(1, 6);
  TrainingCheckpoint last;
  run.callback().onSaveCheckpoint(last);
  const std::string finishedWeights = run.callback().onTrainEnd();
  ASSERT_TRUE(fs::exists(extended.file("0.6.safetensors")));

  run.replaceCallback(smallOptions(extended.path(), 4, outputs.file("b")));
  run.callback().onLoadCheckpoint(last);
  run.fitStart();
  run.epoch(1, stepEveryBatch(6));
  const std::string extendedWeights = run.callback().onTrainEnd();
  expectSameSnapshotsAndSynthesis(straight.path(), extended.path(), scratch.path());
  expectSameFile(straightWeights, extendedWeights);
  // Nothing was lost: the finished run's weights stay, and its final
  // snapshots, the resume folder holding that call's state already, went
  // to superseded/resumed_at_6, equal to that state.
  EXPECT_TRUE(fs::exists(finishedWeights));
  EXPECT_EQ(filesIn(extended.file("superseded")), std::set<std::string>{"resumed_at_6"});
  EXPECT_EQ(filesIn(extended.file("superseded/resumed_at_6")), snapshotNames({6}));
  for (const std::string& name : snapshotNames({6})) {
    expectSameFile(extended.file("resume/" + name),
                   extended.file("superseded/resumed_at_6/" + name));
  }
}

// A checkpoint saved after the end of training holds no resume state (the
// final snapshot is at its call): the extension moves that snapshot into
// the resume folder, where a second resume from the same checkpoint (say,
// after the extension crashed) finds it. That second resume sets aside
// the first extension's snapshots past 6, and a third one those of the
// second, each in its own folder: nothing is overwritten.
TEST(PostHocResumeTest, ExtendingFromACheckpointSavedAfterTheEndCanBeRepeated) {
  TempDir straight, extended, outputs, scratch;
  straightTwelveCalls(straight.path(), outputs.file("a"));
  PostHocRun run(kSeed, smallOptions(extended.path(), 4, outputs.file("b")));
  run.fit(1, 6);
  run.callback().onTrainEnd();
  TrainingCheckpoint afterEnd;
  run.callback().onSaveCheckpoint(afterEnd);
  ASSERT_FALSE(fs::exists(run.callback().resumeFolder()));

  run.replaceCallback(smallOptions(extended.path(), 4, outputs.file("b")));
  run.callback().onLoadCheckpoint(afterEnd);
  run.fitStart();
  EXPECT_EQ(filesIn(extended.file("resume")), snapshotNames({6}));
  EXPECT_FALSE(fs::exists(extended.file("superseded")));
  run.epoch(1, stepEveryBatch(6));
  run.callback().onTrainEnd();
  expectSameSnapshotsAndSynthesis(straight.path(), extended.path(), scratch.path());

  for (const char* folder : {"resumed_at_6", "resumed_at_6_2"}) {
    // Its raw weights at call 6, trained with a callback of its own.
    TempDir elsewhere;
    PostHocRun again(kSeed, smallOptions(elsewhere.path(), 4, outputs.file("c")));
    again.fit(1, 6);
    again.replaceCallback(smallOptions(extended.path(), 4, outputs.file("c")));
    again.callback().onLoadCheckpoint(afterEnd);
    again.fitStart();
    const std::string aside = extended.file(std::string("superseded/") + folder);
    EXPECT_EQ(filesIn(aside), snapshotNames({8, 12})) << folder;
    for (const std::string& name : snapshotNames({8, 12})) {
      expectSameFile(straight.file(name), aside + "/" + name);
    }
    again.epoch(1, stepEveryBatch(6));
    again.callback().onTrainEnd();
    expectSameSnapshotsAndSynthesis(straight.path(), extended.path(), scratch.path());
  }
}

TEST(PostHocResumeTest, ValidationBeforeTheFirstSnapshotChangesNothing) {
  TempDir dir;
  PostHocRun run(kSeed, smallOptions(dir.path(), 4));
  run.fitStart();
  run.epoch(0, stepEveryBatch(3));
  const NamedTensors before = cloneModuleTensors(*run.net);
  EXPECT_FALSE(run.callback().onValidationStart());
  EXPECT_FALSE(run.callback().emaSwappedIn());
  run.callback().onValidationEnd();
  const NamedTensors after = moduleTensors(*run.net);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(after[i].second.equal(before[i].second)) << before[i].first;
  }
}

TEST(PostHocResumeTest, ValidationSwapsInTheSynthesisAtTheNewestSnapshot) {
  TempDir dir;
  PostHocRun run(kSeed, smallOptions(dir.path(), 4));
  run.fit(2, 5);
  ASSERT_EQ(run.callback().calls(), 10);
  const NamedTensors raw = cloneModuleTensors(*run.net);

  ASSERT_TRUE(run.callback().onValidationStart());
  EXPECT_TRUE(run.callback().emaSwappedIn());
  // The newest snapshot is at 8, not at calls() = 10 (none exists there).
  SnapshotSynthesisOptions at8;
  at8.sigmaRel = 0.05;
  at8.step = 8;
  const SynthesizedTensors synthesized =
      synthesizeSnapshots(scanSnapshotFolder(dir.path()).snapshots, at8);
  const posthoc_test::Values independent =
      posthoc_test::referenceSynthesis(dir.path(), {0.05, 0.1}, {4, 8}, 0.05, 8);
  posthoc_test::Values live;
  for (const auto& [name, tensor] : moduleTensors(*run.net)) live[name] = tensor.detach().clone();
  for (const auto& [name, tensor] : synthesized.tensors) {
    if (!at::isFloatingType(tensor.scalar_type())) continue;
    EXPECT_TRUE(live.at(name).equal(tensor.to(live.at(name).scalar_type()))) << name;
    EXPECT_TRUE(posthoc_test::closeTo(live.at(name), independent.at(name), 1e-6, name));
  }
  // The integer buffer stays live (10 batches counted), not the EMA's 0.
  EXPECT_EQ(live.at("bn.num_batches_tracked").item<int64_t>(), 10);

  run.callback().onValidationEnd();
  EXPECT_FALSE(run.callback().emaSwappedIn());
  const NamedTensors restored = moduleTensors(*run.net);
  ASSERT_EQ(restored.size(), raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    EXPECT_TRUE(restored[i].second.equal(raw[i].second)) << raw[i].first;
  }
  // Training goes on from the raw weights and the EMA is untouched by the
  // swap: the snapshot at 12 is still the reference EMA.
  run.epoch(2, stepEveryBatch(2));
  ASSERT_EQ(run.callback().calls(), 12);
  const posthoc_test::Values expected = posthoc_test::referenceEma(run.counted, 0.1, 12);
  const TensorFile snapshot = readTensorFile(dir.file("1.12.safetensors"));
  for (const auto& [name, want] : expected) {
    EXPECT_TRUE(posthoc_test::closeTo(snapshot.at(name), want, 1e-6, "after swap " + name));
  }
}

}  // namespace
}  // namespace shardema::posthoc_test
