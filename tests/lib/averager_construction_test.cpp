// Constructors that cannot finish leave nothing behind: a source without
// values (meta, sparse) or that could never be saved (a complex copy) is
// refused up front naming it, and a failure part-way through building the
// EMA (an allocation, injected at a chosen tensor) unwinds the engine's
// thread and the pipeline without a crash or a thread left running, in the
// Averager, the ShardedAverager and both callbacks' onFitStart. Runs under
// ASan and TSan (label concurrency).
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "shardema/averager.h"
#include "shardema/core/failpoint.h"
#include "shardema/ema_callback.h"
#include "shardema/offload/worker_pool.h"
#include "shardema/posthoc_callback.h"
#include "shardema/sharded_averager.h"
#include "shardema/training_checkpoint.h"
#include "support/temp_dir.h"
#include "support/test_net.h"
#include "support/value_error.h"

namespace shardema {
namespace {

// The EMA storage of tracked tensor `index` fails to allocate (once).
failpoint::Predicate atTensor(size_t index) {
  return [index](int64_t tensor, int64_t) { return tensor == static_cast<int64_t>(index); };
}
constexpr const char* kAllocate = "lib.ema_storage.allocate";

// Threads of this process now: what a half-built engine or pipeline would
// leave running.
size_t threadCount() {
  size_t count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++count;
  }
  return count;
}

std::string errorOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<did not throw>";
}

std::vector<TrackedTensor> fourTensors() {
  return {{"a", at::ones({64})},
          {"b", at::arange(32, at::kFloat)},
          {"c", at::zeros({8, 8})},
          {"n", at::zeros({1}, at::kLong), TrackRole::kCopy}};
}

AveragerOptions optionsFor(EmaStorage storage, offload::WorkerPool& pool) {
  AveragerOptions options;
  options.storage = storage;
  options.pool = &pool;
  return options;
}

class AveragerConstructionTest : public ::testing::TestWithParam<EmaStorage> {
 protected:
  offload::WorkerPool pool_{2};
};

TEST_P(AveragerConstructionTest, MetaSourceIsRefusedNamingIt) {
  const AveragerOptions options = optionsFor(GetParam(), pool_);
  std::vector<TrackedTensor> tracked = fourTensors();
  tracked[2].source = at::empty({8, 8}, at::TensorOptions().device(at::kMeta));
  EXPECT_VALUE_ERROR(Averager(tracked, options), "tensor 'c'");
  EXPECT_VALUE_ERROR(Averager(tracked, options), "meta device");
  tracked[2].role = TrackRole::kCopy;  // a copy needs values too
  EXPECT_VALUE_ERROR(Averager(tracked, options), "meta device");
}

TEST_P(AveragerConstructionTest, SparseSourceIsRefusedNamingIt) {
  const AveragerOptions options = optionsFor(GetParam(), pool_);
  std::vector<TrackedTensor> tracked = fourTensors();
  tracked[1].source = at::ones({4, 4}).to_sparse();
  EXPECT_VALUE_ERROR(Averager(tracked, options), "tensor 'b' has layout");
}

TEST_P(AveragerConstructionTest, ComplexCopyIsRefusedBeforeSave) {
  const AveragerOptions options = optionsFor(GetParam(), pool_);
  std::vector<TrackedTensor> tracked = fourTensors();
  tracked[3].source = at::zeros({2}, at::kComplexFloat);
  const std::string message = errorOf([&] { Averager(tracked, options); });
  EXPECT_NE(message.find("tensor 'n' is tracked as a copy"), std::string::npos) << message;
  EXPECT_THROW(Averager(tracked, options), c10::TypeError);
}

// Each tensor in turn fails to allocate, after the ones before it were
// built: every time a clean error, no thread left over, and the next
// Averager on the same pool works.
TEST_P(AveragerConstructionTest, FailurePartWayUnwindsCleanly) {
  const AveragerOptions options = optionsFor(GetParam(), pool_);
  {
    Averager warm(fourTensors(), options);  // lazy statics
  }
  const size_t threadsBefore = threadCount();
  for (size_t index = 0; index < 4; ++index) {
    failpoint::Armed failing(kAllocate, atTensor(index), /*once=*/true);
    const std::string message = errorOf([&] { Averager(fourTensors(), options); });
    EXPECT_NE(message.find("tracked tensor " + std::to_string(index)), std::string::npos)
        << message;
    EXPECT_EQ(threadCount(), threadsBefore) << "a thread outlived the failed constructor";
  }
  std::vector<TrackedTensor> tracked = fourTensors();
  Averager averager(tracked, options);
  tracked[0].source.fill_(3.0f);
  averager.update(1);
  averager.wait();
  EXPECT_TRUE(averager.ema("a").equal(at::full({64}, 3.0f)));
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// The real-world case of the seam above: 2^46 elements (256 TiB as
// float32, beyond any address space, so no overcommit setting lets it
// through) expanded from one. The allocation fails after the first tensor
// was built. Not under the sanitizers, whose allocators abort on such a size.
TEST_P(AveragerConstructionTest, AllocationLargerThanMemoryIsAnError) {
  const AveragerOptions options = optionsFor(GetParam(), pool_);
  std::vector<TrackedTensor> tracked = fourTensors();
  tracked[1].source = at::ones({1}).expand({int64_t{1} << 46});
  EXPECT_THROW(Averager(tracked, options), c10::Error);
}
#endif

INSTANTIATE_TEST_SUITE_P(Storages, AveragerConstructionTest,
                         ::testing::Values(EmaStorage::kPinnedHost, EmaStorage::kDevice));

TEST(ShardedAveragerConstructionTest, FailurePartWayUnwindsCleanly) {
  offload::WorkerPool pool(2);
  AveragerOptions options;
  options.pool = &pool;
  const auto shards = [] {
    return shardsFromFullTensors(fourTensors(), shard::LayoutKind::kFsdp2, 1, 2);
  };
  { ShardedAverager warm(1, 2, shards(), options); }
  const size_t threadsBefore = threadCount();
  failpoint::Armed failing(kAllocate, atTensor(2), /*once=*/true);
  EXPECT_NE(errorOf([&] { ShardedAverager(1, 2, shards(), options); }).find("tracked tensor 2"),
            std::string::npos);
  EXPECT_EQ(threadCount(), threadsBefore);
  std::vector<TrackedTensor> meta = fourTensors();
  meta[0].source = at::empty({64}, at::TensorOptions().device(at::kMeta));
  EXPECT_VALUE_ERROR(
      ShardedAverager(0, 1, shardsFromFullTensors(meta, shard::LayoutKind::kFsdp2, 0, 1), options),
      "tensor 'a' is on the meta device");
}

struct MetaNet : torch::nn::Module {
  MetaNet() {
    register_parameter("weight", torch::ones({4}));
    register_parameter("lazy", torch::empty({4}, torch::TensorOptions().device(torch::kMeta)));
  }
};

// onFitStart on `net`, then one counted optimizer step `step`, waited for.
void fitAndStep(EmaCallback& callback, testing::TestNet& net, int64_t step) {
  callback.onFitStart(*net);
  callback.onTrainBatchEnd(step, 0, 1, false);
  callback.wait();
}

TEST(EmaCallbackConstructionTest, MetaParameterIsRefusedNamingIt) {
  MetaNet net;
  EmaCallback callback;
  EXPECT_VALUE_ERROR(callback.onFitStart(net), "tensor 'lazy' is on the meta device");
  EXPECT_FALSE(callback.hasEma());
}

// A checkpoint whose EMA progress does not load: onFitStart throws and
// keeps no EMA (before, it kept a fresh one, and training went on as if the
// run had just started), and the state stays queued, so a retry fails the
// same way instead of silently skipping the resume.
TEST(EmaCallbackConstructionTest, FailedResumeLeavesNoEma) {
  testing::TestNet net;
  EmaCallback first;
  fitAndStep(first, net, 1);
  TrainingCheckpoint checkpoint = TrainingCheckpoint::capture(*net);
  first.onSaveCheckpoint(checkpoint);
  checkpoint.metadata.at("shardema.ema.step") = "one";

  EmaCallback resumed;
  resumed.onLoadCheckpoint(*net, checkpoint);
  EXPECT_VALUE_ERROR(resumed.onFitStart(*net), "shardema.step");
  EXPECT_FALSE(resumed.hasEma());
  EXPECT_VALUE_ERROR(resumed.onFitStart(*net), "shardema.step");
  EXPECT_FALSE(resumed.hasEma());
}

TEST(EmaCallbackConstructionTest, FailurePartWayKeepsThePreviousEma) {
  testing::TestNet net;
  EmaCallback callback;
  fitAndStep(callback, net, 3);
  failpoint::Armed failing(kAllocate, atTensor(4), /*once=*/true);
  EXPECT_THROW(callback.onFitStart(*net), c10::Error);
  ASSERT_TRUE(callback.hasEma());
  EXPECT_EQ(callback.averager().step(), 3) << "the EMA built before is kept";
}

TEST(PostHocCallbackConstructionTest, FailedResumeLeavesNoEma) {
  testing::TempDir dir;
  testing::TestNet net;
  PostHocCallbackOptions options;
  options.checkpointFolder = dir.file("posthoc");
  options.checkpointEvery = 2;
  PostHocCallback callback(options);
  TrainingCheckpoint checkpoint = TrainingCheckpoint::capture(*net);
  checkpoint.metadata["shardema.posthoc.calls"] = "4";  // no snapshot was ever written
  callback.onLoadCheckpoint(checkpoint);
  EXPECT_VALUE_ERROR(callback.onFitStart(*net), "cannot resume at call 4");
  EXPECT_THROW(callback.onTrainBatchEnd(1, 0, 1, false), c10::Error)
      << "no EMA: training must not go on as a fresh run";
  EXPECT_VALUE_ERROR(callback.onFitStart(*net), "cannot resume at call 4");
}

TEST(PostHocCallbackConstructionTest, FailurePartWayUnwindsCleanly) {
  testing::TempDir dir;
  testing::TestNet net;
  PostHocCallbackOptions options;
  options.checkpointFolder = dir.file("posthoc");
  PostHocCallback callback(options);
  failpoint::Armed failing(kAllocate, atTensor(1), /*once=*/true);
  EXPECT_THROW(callback.onFitStart(*net), c10::Error);
  callback.onFitStart(*net);  // not "called twice": nothing was kept
  EXPECT_TRUE(callback.onTrainBatchEnd(1, 0, 1, false));
}

}  // namespace
}  // namespace shardema
