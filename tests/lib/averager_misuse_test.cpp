// Forgetting fence() is never a silent wrong EMA. The pipeline reports a
// source written in place while the update could read it (autograd version
// checks); with SourceWrites::kFenceRequired (C++) the Averager fails the
// update for it, and an update() with no fence() since the previous one is
// refused; tensors that change in forward() (buffers) are read inside
// update() so they need no fence. (kAdaptive, the Python front's choice:
// averager_source_writes_test.cpp.) Runs under TSan.
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "offload/fake_copy_engine.h"
#include "offload/held_worker.h"
#include "shardema/averager.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

constexpr const char* kAdvice =
    "modified before fence(): call Averager::fence() (EmaCallback::onBeforeOptimizerStep()) "
    "before optimizer.step()";

// The c10::Error message `call` throws ("" and a test failure if none).
std::string errorOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return std::string();
}

AveragerOptions hostOptions(offload::WorkerPool& pool) {
  AveragerOptions options;
  options.pool = &pool;
  options.offload.chunkBytes = 256;  // 64 chunks for 4096 floats
  options.offload.engine = offload::EngineChoice::kHost;
  return options;
}

// A bare pipeline over `pool` and the fake engine, chunks of `chunkBytes`.
offload::UpdatePipelineOptions pipelineOptions(offload::WorkerPool& pool,
                                               testing::FakeCopyEngine& engine,
                                               int64_t chunkBytes) {
  offload::UpdatePipelineOptions options;
  options.pool = &pool;
  options.engine = &engine;
  options.chunkBytes = chunkBytes;
  return options;
}

std::vector<offload::PipelineJob> lerpJob(const at::Tensor& ema, const at::Tensor& source,
                                          const std::string& name) {
  return {offload::PipelineJob{ema, source, UpdateOp::kLerp, name, {}}};
}

// After a reported write to "enc.w" (640 floats in chunks of 256 bytes):
// fresh updates with the write after fence() are never mistaken for one
// during the read.
void expectLaterWritesAfterFenceAreNotReported(offload::UpdatePipeline& pipeline,
                                                const at::Tensor& ema, const at::Tensor& source) {
  for (int64_t step = 10; step < 60; ++step) {
    pipeline.wait();  // the owner's one wait before each update
    pipeline.submit(lerpJob(ema, source, "enc.w"), {0.5f}, step);
    pipeline.fence();
    source.add_(1.0f);
    EXPECT_TRUE(pipeline.writtenWhileRead().empty()) << "step " << step;
    EXPECT_EQ(pipeline.writtenSinceSubmit(), std::vector<size_t>{0}) << "step " << step;
  }
  pipeline.wait();
}

TEST(AveragerMisuseTest, TheAsynchronousUpdateIsTheDefault) {
  EXPECT_FALSE(AveragerOffloadOptions{}.fenceInUpdate);
  EXPECT_FALSE(TrackedTensor{}.changesInForward);
  // The Averager stages like a bare pipeline (averager.h repeats the
  // number rather than include the pipeline's header for it).
  EXPECT_EQ(AveragerOffloadOptions{}.chunkBytes, offload::kDefaultChunkBytes);
  EXPECT_EQ(offload::UpdatePipelineOptions{}.chunkBytes, offload::kDefaultChunkBytes);
  EXPECT_EQ(AveragerOffloadOptions{}.numSlots, offload::kDefaultNumSlots);
  EXPECT_EQ(offload::UpdatePipelineOptions{}.numSlots, offload::kDefaultNumSlots);
  EXPECT_FALSE(offload::UpdatePipelineOptions{}.stageHostSources);
}

// Without fence() the in-place write (as optimizer.step() does) is reported
// by wait(), by fence() + wait(), and by the next update(), naming the
// tensor and the step; the Averager is then failed.
TEST(AveragerMisuseTest, AWriteBeforeFenceFailsTheUpdateNamingTensorAndStep) {
  offload::WorkerPool pool(2);
  for (int where = 0; where < 3; ++where) {
    at::Tensor w = at::zeros({4096});
    at::Tensor other = at::zeros({16});
    Averager averager({{"enc.w", w, TrackRole::kAverage}, {"other", other, TrackRole::kAverage}},
                      hostOptions(pool));
    averager.update(1);
    averager.fence();
    w.fill_(1.0f);
    averager.update(2);
    w.add_(1.0f);  // no fence(): the update may be reading w right now
    std::string message;
    if (where == 0) message = errorOf([&] { averager.wait(); });
    if (where == 1) {
      averager.fence();  // never throws; the write is recorded
      message = errorOf([&] { averager.wait(); });
    }
    if (where == 2) message = errorOf([&] { averager.update(3); });
    EXPECT_NE(message.find("'enc.w'"), std::string::npos) << where << ": " << message;
    EXPECT_NE(message.find("step 2"), std::string::npos) << where << ": " << message;
    EXPECT_NE(message.find(kAdvice), std::string::npos) << where << ": " << message;
    EXPECT_TRUE(averager.failed()) << where;
    EXPECT_THROW(averager.ema("enc.w"), c10::Error) << where;
  }
}

// No write at all, but no fence() either: the second update() is refused
// (LibTorch's C++ optimizers write through tensor.data(), which the version
// check cannot see).
TEST(AveragerMisuseTest, AnUpdateWithoutFenceSinceThePreviousOneIsRefused) {
  offload::WorkerPool pool(1);
  at::Tensor w = at::zeros({100});
  Averager averager({{"w", w, TrackRole::kAverage}}, hostOptions(pool));
  averager.update(1);
  const std::string message = errorOf([&] { averager.update(2); });
  EXPECT_NE(message.find("update(2) came without fence()"), std::string::npos) << message;
  EXPECT_NE(message.find(kAdvice), std::string::npos) << message;
  EXPECT_TRUE(averager.failed());
  // fence(), wait() or a call that waits in between are all fine.
  Averager fine({{"w", w, TrackRole::kAverage}}, hostOptions(pool));
  fine.update(1);
  fine.fence();
  fine.update(2);
  fine.wait();
  fine.update(3);
  fine.ema("w");
  EXPECT_TRUE(fine.update(4));
  fine.wait();
  EXPECT_FALSE(fine.failed());
}

// Buffers change in forward(), right after update() returns and before any
// fence(): they are snapshotted inside update(), so the EMA holds the value
// they had at update() time and nothing fails. Writes after fence() (the
// optimizer step) are fine too.
TEST(AveragerMisuseTest, BuffersChangingInForwardAreReadInsideUpdate) {
  offload::WorkerPool pool(2);
  at::Tensor weight = at::zeros({2000});
  at::Tensor runningMean = at::zeros({700}, at::kBFloat16);
  at::Tensor counter = at::zeros({3}, at::kLong);
  AveragerOptions options = hostOptions(pool);
  options.schedule = DecaySchedule::constant();  // decay 0.9999 from the second update
  Averager averager({{"weight", weight, TrackRole::kAverage},
                     {"bn.running_mean", runningMean, TrackRole::kAverage, true},
                     {"bn.num_batches_tracked", counter, TrackRole::kCopy, true}},
                    options);
  for (int64_t step = 1; step <= 200; ++step) {
    weight.fill_(static_cast<float>(step));
    runningMean.fill_(static_cast<float>(step % 7));
    counter.fill_(step);
    ASSERT_TRUE(averager.update(step));
    // The next forward pass: buffers change while the update may still run.
    runningMean.fill_(1e6f);
    counter.fill_(-1);
    averager.fence();
    weight.fill_(-1e6f);  // the optimizer step, after the fence
  }
  averager.wait();
  EXPECT_FALSE(averager.failed());
  EXPECT_TRUE(at::equal(averager.ema("bn.num_batches_tracked"), at::full({3}, 200, at::kLong)));
  // Lerp of values in [0, 6] and 1..200: far from the 1e6 written later.
  EXPECT_LT(averager.ema("bn.running_mean").abs().max().item<float>(), 7.0f);
  EXPECT_LT(averager.ema("weight").abs().max().item<float>(), 201.0f);
  EXPECT_GT(averager.ema("weight").min().item<float>(), 0.5f);
}

// The landing check: with a host-side engine the worker checks each
// chunk's sources after its copy landed; a source written before then is
// reported (writtenWhileRead), the update does not fail, and the chunk is
// folded in as read (here the write came before every copy: the new values).
TEST(AveragerMisuseTest, TheLandingCheckReportsASourceWrittenBeforeItsCopyLanded) {
  offload::WorkerPool pool(2);
  testing::FakeCopyEngine engine;
  engine.setDelay(std::chrono::milliseconds(30));  // the write wins the race
  offload::UpdatePipelineOptions options = pipelineOptions(pool, engine, 256);
  options.numSlots = 1;
  options.stageHostSources = true;  // the staged path: the check after landing
  offload::UpdatePipeline pipeline(options);
  at::Tensor source = at::arange(640, at::kFloat);
  at::Tensor ema = at::zeros({640});
  pipeline.submit(lerpJob(ema, source, "enc.w"), {0.5f}, 9);
  source.add_(1.0f);  // before the first copy has even started
  pipeline.wait();
  EXPECT_EQ(pipeline.writtenWhileRead(), std::vector<size_t>{0});
  EXPECT_EQ(pipeline.writtenSinceSubmit(), std::vector<size_t>{0});
  EXPECT_TRUE(pipeline.uncheckedReads().empty()) << "the fake engine copies on the host";
  EXPECT_TRUE(at::equal(ema, source.mul(0.5))) << "every chunk read the written values";
  engine.setDelay(std::chrono::microseconds(0));  // however late the worker checks
  expectLaterWritesAfterFenceAreNotReported(pipeline, ema, source);
}

// A moved-from Averager holds no EMA: every call that would read, change,
// save or load one throws saying so, where before some returned nothing
// (emaTensors() an empty list, save() an empty file).
TEST(AveragerMisuseTest, EveryCallOnAMovedFromAveragerSaysSo) {
  offload::WorkerPool pool(2);
  testing::TempDir dir;
  at::Tensor w = at::zeros({64});
  Averager averager({{"w", w, TrackRole::kAverage}}, hostOptions(pool));
  averager.update(1);
  averager.wait();
  averager.save(dir.file("state.safetensors"));
  Averager taken(std::move(averager));
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"update", [&] { averager.update(2); }},
      {"update", [&] { averager.update(1); }},  // a step that is not due later either
      {"fence", [&] { averager.fence(); }},
      {"wait", [&] { averager.wait(); }},
      {"emaTensors", [&] { averager.emaTensors(); }},
      {"emaTensors", [&] { averager.save(dir.file("moved.safetensors")); }},
      {"loadState", [&] { averager.load(dir.file("state.safetensors")); }},
      {"restoreProgress", [&] { averager.restoreProgress(1, true); }},
      {"copyTo", [&] { averager.copyTo(); }},
  };
  for (const auto& [api, call] : calls) {
    const std::string message = errorOf(call);
    EXPECT_NE(message.find(std::string("Averager::") + api + ": this Averager was moved from"),
              std::string::npos)
        << message;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("moved.safetensors")));
  taken.update(2);  // the new owner goes on
  taken.wait();
}

// The direct chunk check: the worker checks a chunk's sources before its
// math (the only worker is held until the write is done, so the write
// surely comes first): the write is reported, the chunk reads the new
// values, and a write after fence() is never mistaken for one during the
// read.
TEST(AveragerMisuseTest, TheDirectChunkCheckReportsASourceWrittenBeforeItsMath) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  offload::UpdatePipeline pipeline(pipelineOptions(pool, engine, 256));
  at::Tensor source = at::arange(640, at::kFloat);
  at::Tensor ema = at::zeros({640});
  testing::HeldWorker held(pool);
  pipeline.submit(lerpJob(ema, source, "enc.w"), {0.5f}, 9);
  source.add_(1.0f);  // before the worker has read anything
  held.release();
  pipeline.wait();
  EXPECT_EQ(engine.copies(), 0) << "the direct path never calls the engine";
  EXPECT_EQ(pipeline.writtenWhileRead(), std::vector<size_t>{0});
  EXPECT_TRUE(at::equal(ema, source.mul(0.5))) << "every chunk read the written values";
  expectLaterWritesAfterFenceAreNotReported(pipeline, ema, source);
}

// Forgotten fence on the direct path: the write is reported after the
// owner's wait() (the pipeline never fails for it); a submit() without that
// wait is refused, naming the step not waited for; with fence() between the
// same calls nothing is reported.
TEST(AveragerMisuseTest, ADirectUpdateWrittenBeforeFenceIsReportedAfterTheNextWait) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  offload::UpdatePipeline pipeline(
      pipelineOptions(pool, engine, offload::UpdatePipelineOptions{}.chunkBytes));
  at::Tensor source = at::ones({1000});
  at::Tensor ema = at::zeros({1000});
  testing::HeldWorker held(pool);
  pipeline.submit(lerpJob(ema, source, "dec.b"), {0.5f}, 4);
  source.mul_(2.0f);  // the optimizer step, without fence()
  held.release();
  const std::string unwaited =
      errorOf([&] { pipeline.submit(lerpJob(ema, source, "dec.b"), {0.5f}, 5); });
  EXPECT_NE(unwaited.find("the update of step 4 has not been waited for; call wait() before "
                          "submitting step 5"),
            std::string::npos)
      << unwaited;
  pipeline.wait();
  EXPECT_EQ(pipeline.writtenSinceSubmit(), std::vector<size_t>{0});
  EXPECT_EQ(pipeline.writtenWhileRead(), std::vector<size_t>{0}) << "the math came after it";
  pipeline.submit(lerpJob(ema, source, "dec.b"), {0.5f}, 6);
  pipeline.fence();
  source.mul_(2.0f);
  pipeline.wait();
  EXPECT_TRUE(pipeline.writtenWhileRead().empty());
  EXPECT_EQ(pipeline.writtenSinceSubmit(), std::vector<size_t>{0}) << "moved after fence";
  EXPECT_TRUE(at::equal(ema, at::full({1000}, 1.5f))) << "step 6 lerped 2.0 into 1.0 at 0.5";
}

// The pipeline keeps a source's version handle from update to update while
// the job holds the same tensor; a new tensor in the same place gets its
// own, and so does a job naming another tensor's counter (a DTensor's).
// Otherwise a write to the new one before fence() would go unseen (the old
// tensor's counter never moves).
TEST(AveragerMisuseTest, ANewSourceTensorInAJobsPlaceIsCheckedByItsOwnCounter) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  offload::UpdatePipeline pipeline(
      pipelineOptions(pool, engine, offload::UpdatePipelineOptions{}.chunkBytes));
  at::Tensor ema = at::zeros({1000});
  at::Tensor first = at::ones({1000});
  for (int64_t step = 1; step <= 3; ++step) {  // the same tensor: handle kept
    pipeline.submit(lerpJob(ema, first, "dec.b"), {0.5f}, step);
    pipeline.fence();
    first.add_(1.0f);
  }
  at::Tensor second = first.clone();  // e.g. a re-materialised parameter
  pipeline.wait();
  pipeline.submit(lerpJob(ema, second, "dec.b"), {0.5f}, 4);
  second.add_(1.0f);  // before fence()
  pipeline.wait();
  EXPECT_EQ(pipeline.writtenSinceSubmit(), std::vector<size_t>{0});
  // And back to the first tensor: its handle is taken afresh and checked.
  pipeline.submit(lerpJob(ema, first, "dec.b"), {0.5f}, 5);
  first.add_(1.0f);
  pipeline.wait();
  EXPECT_EQ(pipeline.writtenSinceSubmit(), std::vector<size_t>{0});
  // A job naming another tensor's counter reads that one: writes to the
  // source itself (a DTensor's local) are not what it watches.
  at::Tensor owner = at::zeros({1});
  std::vector<offload::PipelineJob> jobs = lerpJob(ema, first, "dec.b");
  jobs[0].version = owner.unsafeGetTensorImpl()->version_counter();
  pipeline.submit(jobs, {0.5f}, 6);
  first.add_(1.0f);
  pipeline.wait();
  EXPECT_TRUE(pipeline.writtenSinceSubmit().empty()) << "the source's own counter is not read";
  pipeline.submit(jobs, {0.5f}, 7);
  owner.add_(1.0f);
  pipeline.wait();
  EXPECT_EQ(pipeline.writtenSinceSubmit(), std::vector<size_t>{0});
}

}  // namespace
}  // namespace shardema
