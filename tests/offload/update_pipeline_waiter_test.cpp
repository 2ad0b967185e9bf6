// UpdatePipeline: the thread blocked in fence() or wait() runs the direct
// chunks no worker has claimed. Each test holds the pool's only worker, so
// the pipeline can finish the unclaimed chunks only on the waiting thread:
// without that help these tests fail on their deadline instead of hanging.
// Runs under ThreadSanitizer too.
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "offload/fake_copy_engine.h"
#include "offload/held_worker.h"
#include "shardema/core/failpoint.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"

namespace shardema {
namespace {

using offload::PipelineJob;
using offload::UpdatePipeline;

constexpr int64_t kElements = 640;  // 10 direct chunks of 64 floats
constexpr int64_t kChunkBytes = 256;
constexpr int64_t kChunks = 10;

struct Fixture {
  offload::WorkerPool pool{1};
  testing::FakeCopyEngine engine;
  UpdatePipeline pipeline{[this] {
    offload::UpdatePipelineOptions options;
    options.chunkBytes = kChunkBytes;
    options.pool = &pool;
    options.engine = &engine;
    return options;
  }()};
  at::Tensor source = at::arange(kElements, at::kFloat);
  at::Tensor ema = at::zeros({kElements});

  std::vector<PipelineJob> jobs() const {
    return {PipelineJob{ema, source, UpdateOp::kLerp, "enc.w", {}}};
  }
  // Submits update `step` while the worker is held, so that it can start
  // only the chunk submit() gave it, and runs `waitCall` (fence or wait).
  // The worker is released once the waiter has taken every other chunk
  // (waiterChunks grew by kChunks - 1), or after 10 s: then the
  // expectations fail instead of the test hanging.
  void runWithHeldWorker(float weight, int64_t step, const std::function<void()>& waitCall) {
    testing::HeldWorker held(pool);
    const int64_t target = pipeline.stats().waiterChunks + kChunks - 1;
    pipeline.submit(jobs(), {weight}, step);
    std::thread releaser([this, &held, target] {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (pipeline.stats().waiterChunks < target &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      held.release();
    });
    waitCall();
    releaser.join();
  }
};

// The EMA of the fixture after one lerp of weight 0.5 from zero, in float64
// (independent of the kernels): 0 + 0.5 * (x - 0) = x / 2, exact in float32
// too, so the pipeline's result must equal it bit for bit.
at::Tensor referenceAfterOneLerp(const at::Tensor& source) {
  return source.to(at::kDouble).mul(0.5).to(at::kFloat);
}

// submit() gave chunk 0 to the held worker; fence() runs chunks 1-9 on this
// thread, then waits for chunk 0 like before.
TEST(UpdatePipelineWaiterTest, FenceRunsTheChunksNoWorkerHasStarted) {
  Fixture f;
  f.runWithHeldWorker(0.5f, 1, [&] { f.pipeline.fence(); });
  EXPECT_EQ(f.pipeline.stats().waiterChunks, kChunks - 1)
      << "fence() slept while the worker was held instead of running chunks 1-9";
  const at::Tensor reference = referenceAfterOneLerp(f.source);
  f.source.fill_(-1.0f);  // the optimizer step, after the fence
  f.pipeline.wait();
  EXPECT_TRUE(at::equal(f.ema, reference)) << "bitwise as one thread would have done it";
  EXPECT_EQ(f.engine.copies(), 0);
}

// The same through wait() without fence() (it checks and releases the
// sources as fence() would), then an update the worker runs alone: the
// waiter's count only moves when a waiter ran chunks.
TEST(UpdatePipelineWaiterTest, WaitRunsThemTooAndOnlyThoseCount) {
  Fixture f;
  f.runWithHeldWorker(0.5f, 1, [&] { f.pipeline.wait(); });
  EXPECT_EQ(f.pipeline.stats().waiterChunks, kChunks - 1);
  EXPECT_TRUE(f.pipeline.sourcesReleased());
  EXPECT_TRUE(at::equal(f.ema, referenceAfterOneLerp(f.source)));

  // An idle worker given time drains every chunk before anyone waits.
  f.pipeline.submit(f.jobs(), {0.5f}, 2);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (f.pipeline.busy() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  f.pipeline.wait();
  EXPECT_EQ(f.pipeline.stats().waiterChunks, kChunks - 1) << "the worker ran update 2 alone";
  EXPECT_EQ(f.pipeline.stats().chunks, 2 * kChunks);
}

// A chunk that fails on the waiting thread fails the update as a worker's
// would: fence() does not throw, wait() rethrows once naming the tensor,
// chunk and step, the chunks after it are skipped, and the next update
// goes through.
TEST(UpdatePipelineWaiterTest, AFailureOnTheWaiterIsReportedByWait) {
  Fixture f;
  failpoint::Armed fault("offload.pipeline.chunk",
                         [](int64_t step, int64_t chunk) { return step == 3 && chunk == 4; });
  // Chunks 1-9 on this thread, chunk 4 throws.
  f.runWithHeldWorker(0.5f, 3, [&] { f.pipeline.fence(); });
  EXPECT_EQ(f.pipeline.stats().waiterChunks, kChunks - 1) << "skipped chunks count as run";
  try {
    f.pipeline.wait();
    FAIL() << "expected the injected fault";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("step 3"), std::string::npos) << message;
    EXPECT_NE(message.find("'enc.w' (chunk 4 of 10)"), std::string::npos) << message;
    EXPECT_NE(message.find("injected fault"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(f.pipeline.wait()) << "reported once";
  // Chunks 1-3 ran before the fault, 5-9 were skipped after it; chunk 0 is
  // the worker's and may have run either way.
  const at::Tensor reference = referenceAfterOneLerp(f.source);
  EXPECT_TRUE(at::equal(f.ema.slice(0, 64, 256), reference.slice(0, 64, 256)));
  EXPECT_TRUE(at::equal(f.ema.slice(0, 256, kElements), at::zeros({kElements - 256})));

  f.pipeline.submit(f.jobs(), {1.0f}, 4);
  f.pipeline.wait();
  EXPECT_TRUE(at::equal(f.ema, f.source));
}

}  // namespace
}  // namespace shardema
