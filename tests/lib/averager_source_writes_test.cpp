// SourceWrites::kAdaptive (the Python front's choice): no write ever fails
// the Averager; the first due update reads before it returns, and a source
// seen written between update() and the next fence() is read inside
// update() from then on, with one warning; so loops that write the same
// tensors at every step (an optimizer with no fence, weight clipping after
// the update) are exact against a float64 EMA of what the loop held at each
// update() call. And fenceEveryAverager(), the registry's one call. Runs
// under TSan.
#include "shardema/averager.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "offload/held_worker.h"
#include "shardema/core/failpoint.h"
#include "shardema/averager_registry.h"
#include "shardema/offload/worker_pool.h"

namespace shardema {
namespace {

// Records what reaches c10's warning handler while it is installed.
class RecordingHandler : public c10::WarningHandler {
 public:
  RecordingHandler() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~RecordingHandler() override { c10::WarningUtils::set_warning_handler(previous_); }
  RecordingHandler(const RecordingHandler&) = delete;
  RecordingHandler& operator=(const RecordingHandler&) = delete;
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningHandler* previous_;
};

AveragerOptions adaptive(offload::WorkerPool& pool) {
  AveragerOptions options;
  options.pool = &pool;
  options.offload.chunkBytes = 256;  // many chunks, so reads take a while
  options.offload.engine = offload::EngineChoice::kHost;
  ConstantScheduleOptions constant;
  constant.decay = 0.75;
  options.schedule = DecaySchedule::constant(constant);
  options.sourceWrites = SourceWrites::kAdaptive;
  return options;
}

// A float64 EMA of the values given at each due update: the first copies,
// later ones lerp with weight 1 - 0.75.
struct ReferenceEma {
  at::Tensor value;
  void fold(const at::Tensor& source) {
    const at::Tensor now = source.to(at::kDouble);
    value = value.defined() ? value.mul(0.75).add(now.mul(0.25)) : now.clone();
  }
  // Relative to the largest value: float32 rounding is all that may differ.
  double maxDifference(const at::Tensor& ema) const {
    const double scale = std::max(1.0, value.abs().max().item().toDouble());
    return ema.to(at::kDouble).sub(value).abs().max().item().toDouble() / scale;
  }
};

TEST(AveragerSourceWritesTest, TheFirstDueUpdateReadsEverySourceBeforeItReturns) {
  offload::WorkerPool pool(1);
  at::Tensor w = at::arange(4096, at::kFloat);
  const at::Tensor atUpdate = w.clone();
  Averager averager({{"w", w, TrackRole::kAverage}}, adaptive(pool));
  // Every chunk's math starts 2 ms late (a predicate that never fires but
  // sleeps): a read left to the background would still be going on when
  // the write below comes.
  failpoint::Armed slow("offload.pipeline.chunk", [](int64_t, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return false;
  });
  averager.update(1);
  w.fill_(-1.0f);  // right after update() returns
  averager.wait();
  EXPECT_TRUE(at::equal(averager.ema("w"), atUpdate));
  EXPECT_FALSE(averager.failed());
}

// The loop every ema-pytorch user writes, with nothing to fence before the
// optimizer: the write of step k happens while update(k - 1) may still read.
// From the second update on the written source is read inside update(), so
// the EMA is exact, one warning names it, and nothing fails.
TEST(AveragerSourceWritesTest, AnUnfencedLoopIsExactAndNeverFails) {
  offload::WorkerPool pool(2);
  at::Tensor w = at::zeros({4096});
  at::Tensor untouched = at::full({300}, 2.0f);
  Averager averager({{"w", w, TrackRole::kAverage}, {"untouched", untouched, TrackRole::kAverage}},
                    adaptive(pool));
  RecordingHandler warnings;
  ReferenceEma reference;
  for (int64_t step = 1; step <= 40; ++step) {
    w.add_(at::arange(4096, at::kFloat).mul(1e-3).add(static_cast<double>(step)));  // "optimizer.step()"
    ASSERT_TRUE(averager.update(step));
    reference.fold(w);
  }
  averager.wait();
  EXPECT_FALSE(averager.failed());
  EXPECT_LT(reference.maxDifference(averager.ema("w")), 1e-6);
  EXPECT_EQ(averager.readInsideUpdate(), std::vector<std::string>{"w"});
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("'w' was written in place after update(1)"),
            std::string::npos)
      << warnings.messages[0];
  EXPECT_EQ(warnings.messages[0].find("may mix"), std::string::npos)
      << "update(1) read before it returned: " << warnings.messages[0];
}

// Weight clipping after the update, before the fence (Lightning runs the
// module's on_train_batch_end after the callbacks'): exact from the first
// step, with the EMA of the values update() saw (not the clipped ones).
TEST(AveragerSourceWritesTest, AWriteAfterUpdateAndBeforeFenceIsReadInsideUpdateFromThenOn) {
  offload::WorkerPool pool(2);
  at::Tensor w = at::zeros({4096});
  Averager averager({{"w", w, TrackRole::kAverage}}, adaptive(pool));
  RecordingHandler warnings;
  ReferenceEma reference;
  // Each chunk's math starts 1 ms late, so a read left to the background
  // overlaps the clipping.
  failpoint::Armed slow("offload.pipeline.chunk", [](int64_t, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return false;
  });
  for (int64_t step = 1; step <= 10; ++step) {
    averager.fence();  // the optimizer's pre-step fence
    w.add_(at::arange(4096, at::kFloat).mul(1e-3).sub(2.0));  // the optimizer step
    ASSERT_TRUE(averager.update(step));
    reference.fold(w);
    w.clamp_(-1.0f, 1.0f);  // clipping after the update
  }
  averager.wait();
  EXPECT_FALSE(averager.failed());
  EXPECT_LT(reference.maxDifference(averager.ema("w")), 1e-6);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("from now on update() reads it before it returns"),
            std::string::npos)
      << warnings.messages[0];
}

// A loop that fences before its writes keeps every read in the background.
TEST(AveragerSourceWritesTest, WritesAfterFenceKeepTheReadsInTheBackground) {
  offload::WorkerPool pool(2);
  at::Tensor w = at::zeros({4096});
  Averager averager({{"w", w, TrackRole::kAverage}}, adaptive(pool));
  RecordingHandler warnings;
  ReferenceEma reference;
  for (int64_t step = 1; step <= 20; ++step) {
    w.add_(1.5f);
    ASSERT_TRUE(averager.update(step));
    reference.fold(w);
    averager.fence();
    w.clamp_(-10.0f, 10.0f);
  }
  averager.wait();
  EXPECT_LT(reference.maxDifference(averager.ema("w")), 1e-6);
  EXPECT_TRUE(averager.readInsideUpdate().empty());
  EXPECT_TRUE(warnings.messages.empty());
}

// A write that surely overlaps a background read (the only worker is held
// until the write is done; the direct chunk check sees it): the warning
// says the step may mix values, the Averager goes on, and the next steps
// read the source inside update().
TEST(AveragerSourceWritesTest, AWriteDuringABackgroundReadIsWarnedAsMixedAndNothingFails) {
  offload::WorkerPool pool(1);
  at::Tensor w = at::zeros({4096});
  Averager averager({{"w", w, TrackRole::kAverage}}, adaptive(pool));
  averager.update(1);  // read before it returns
  averager.fence();
  RecordingHandler warnings;
  {
    testing::HeldWorker held(pool);
    w.fill_(1.0f);
    averager.update(2);
    w.fill_(5.0f);  // while update(2) has read nothing yet
    held.release();
    averager.fence();
  }
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("The EMA of step 2 may mix the values of 'w'"),
            std::string::npos)
      << warnings.messages[0];
  EXPECT_FALSE(averager.failed());
  EXPECT_EQ(averager.readInsideUpdate(), std::vector<std::string>{"w"});
  at::Tensor before = averager.ema("w").clone();
  averager.update(3);
  w.fill_(-100.0f);
  averager.wait();
  EXPECT_TRUE(at::allclose(averager.ema("w"), before.mul(0.75).add(1.25)))
      << "update(3) read w inside update()";
}

// The registry: fenceEveryAverager() fences every live Averager (with
// kFenceRequired an update() with no fence since the previous one is
// refused, so the next update() tells whether it was fenced), skips failed
// ones, and forgets destroyed ones.
TEST(AveragerSourceWritesTest, FenceEveryAveragerFencesEachLiveOne) {
  offload::WorkerPool pool(1);
  const size_t before = liveAveragers();
  at::Tensor a = at::arange(4096, at::kFloat);
  at::Tensor b = at::arange(4096, at::kFloat).mul(2.0);
  AveragerOptions options;
  options.pool = &pool;
  options.offload.engine = offload::EngineChoice::kHost;
  Averager first({{"a", a, TrackRole::kAverage}}, options);
  auto second = std::make_unique<Averager>(
      std::vector<TrackedTensor>{{"b", b, TrackRole::kAverage}}, options);
  EXPECT_EQ(liveAveragers(), before + 2);
  first.update(1);
  second->update(1);
  fenceEveryAverager();
  a.add_(1.0f);  // the optimizer step
  b.add_(1.0f);
  EXPECT_NO_THROW(first.update(2));
  EXPECT_NO_THROW(second->update(2));
  EXPECT_FALSE(first.failed());
  // A failed Averager is left for its owner: fenceEveryAverager() does not
  // throw for it, and its next call still reports the failure.
  b.add_(1.0f);  // written before any fence: the update of step 2 fails
  fenceEveryAverager();
  EXPECT_TRUE(second->failed());
  fenceEveryAverager();
  EXPECT_THROW(second->wait(), c10::Error);
  first.wait();
  Averager moved(std::move(first));
  EXPECT_EQ(liveAveragers(), before + 3) << "the moved-from one until destroyed";
  second.reset();
  EXPECT_EQ(liveAveragers(), before + 2);
  fenceEveryAverager();  // the moved-from one holds no EMA: skipped
  EXPECT_NO_THROW(moved.update(3));
}

}  // namespace
}  // namespace shardema
