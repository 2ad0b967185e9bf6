// UpdatePipeline: ordering (bit-identical to a synchronous reference with
// sources overwritten right after fence), errors, fence vs wait, swap-in;
// on the staged path (host sources through the engine, as device sources
// go), the direct path (host sources read in place) and both in one update.
// Runs under ThreadSanitizer too. A few lines over the 400-line guideline:
// the three paths share one fixture and its reference, which a split would
// copy.
#include "shardema/offload/update_pipeline.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <future>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "offload/fake_copy_engine.h"
#include "shardema/core/failpoint.h"
#include "shardema/core/update_kernels.h"
#include "shardema/offload/detail/host_copy_engine.h"
#include "shardema/offload/pinned_arena.h"
#include "shardema/offload/worker_pool.h"
#include "support/same_bytes.h"

namespace shardema {
namespace {

using offload::PipelineJob;
using offload::UpdatePipeline;
using offload::UpdatePipelineOptions;

// 1000 steps per configuration under ThreadSanitizer too: the tensors are
// small, so the whole sweep takes about a second there.
constexpr int64_t kSteps = 1000;

// One tracked tensor of the ordering test and its synchronous reference.
struct Tracked {
  std::string name;
  at::Tensor source;     // what the pipeline reads
  at::Tensor ema;        // what the pipeline writes
  at::Tensor reference;  // updated with the plain kernels on the caller
  bool raw = false;
};

SourceType typeOf(at::ScalarType dtype) {
  return dtype == at::kFloat      ? SourceType::kFloat32
         : dtype == at::kBFloat16 ? SourceType::kBFloat16
                                  : SourceType::kFloat16;
}

// Fresh values for a step: random floats (or integers for raw copies).
void fillSource(Tracked& t, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  at::Tensor fp32 = at::empty({t.source.numel()}, at::kFloat);
  float* p = fp32.data_ptr<float>();
  for (int64_t i = 0; i < fp32.numel(); ++i)
    p[i] = t.raw ? std::floor(value(rng) * 1000) : value(rng);
  t.source.copy_(fp32);
}

void applyReference(Tracked& t, UpdateOp op, float weight) {
  if (t.raw) {
    t.reference.copy_(t.source);
    return;
  }
  float* ref = t.reference.data_ptr<float>();
  const SourceType type = typeOf(t.source.scalar_type());
  if (op == UpdateOp::kCopy) {
    copyRange(ref, t.source.data_ptr(), type, t.source.numel());
  } else {
    lerpRange(ref, t.source.data_ptr(), type, t.source.numel(), weight);
  }
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && testing::sameBytes(a.data_ptr(), b.data_ptr(), a.nbytes());
}

std::vector<Tracked> randomTensors(std::mt19937& rng, int64_t maxElements) {
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  const int64_t sizes[] = {0, 1, 3, 17, 64, 255, 700};
  std::vector<Tracked> out;
  const int count = std::uniform_int_distribution<int>(1, 6)(rng);
  for (int i = 0; i < count; ++i) {
    Tracked t;
    t.name = "t" + std::to_string(i);
    t.raw = rng() % 6 == 0;
    const int64_t n = std::min(maxElements, sizes[rng() % 7]);
    const at::ScalarType dtype = t.raw ? at::kLong : dtypes[rng() % 3];
    t.source = at::zeros({n}, dtype);
    t.ema = at::zeros({n}, t.raw ? at::kLong : at::kFloat);
    t.reference = t.ema.clone();
    out.push_back(std::move(t));
  }
  return out;
}

// Which path the host sources of a test take.
enum class Path { kStaged, kDirect, kMixed };

const char* nameOf(Path path) {
  return path == Path::kStaged ? "staged" : path == Path::kDirect ? "direct" : "mixed";
}

UpdatePipelineOptions optionsFor(Path path, offload::WorkerPool& pool, offload::CopyEngine& engine,
                                 int64_t chunkBytes, int slots = 2) {
  UpdatePipelineOptions options;
  options.chunkBytes = chunkBytes;
  options.numSlots = slots;
  options.pool = &pool;
  options.engine = &engine;
  options.stageHostSources = path == Path::kStaged;
  return options;
}

void orderingSweep(Path path, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t chunkChoices[] = {64, 100, 256, 1000, 4096, int64_t{1} << 20};
  for (int config = 0; config < 5; ++config) {
    const int64_t chunkBytes = chunkChoices[rng() % 6];
    const int slots = 1 + static_cast<int>(rng() % 4);
    offload::WorkerPool pool(1 + static_cast<int>(rng() % 3));
    std::vector<Tracked> tensors = randomTensors(rng, chunkBytes < 256 ? 64 : 700);
    // Odd configurations run the real host engine, even ones the fake
    // (which also counts how many copies were queued at once).
    testing::FakeCopyEngine fake;
    offload::HostCopyEngine host;
    offload::CopyEngine& engine = config % 2 == 1 ? static_cast<offload::CopyEngine&>(host) : fake;
    UpdatePipeline pipeline(optionsFor(path, pool, engine, chunkBytes, slots));
    // Mixed: odd jobs' host sources staged, even ones read in place.
    std::optional<failpoint::Armed> mixed;
    if (path == Path::kMixed) {
      mixed.emplace("offload.pipeline.stage_host_source",
                    [](int64_t job, int64_t) { return job % 2 == 1; });
    }
    const std::string where = std::string(nameOf(path)) + " " + engine.name() + " config " +
                              std::to_string(config) + " chunkBytes " + std::to_string(chunkBytes) +
                              " slots " + std::to_string(slots) + " workers " +
                              std::to_string(pool.size());
    for (int64_t step = 1; step <= kSteps; ++step) {
      // A copy now and then (the first update, a frozen layer), lerps else.
      const UpdateOp op = step == 1 || rng() % 50 == 0 ? UpdateOp::kCopy : UpdateOp::kLerp;
      const float weight = 1.0f / (1.0f + 0.01f * static_cast<float>(step));
      std::vector<PipelineJob> jobs;
      for (Tracked& t : tensors) {
        fillSource(t, rng);
        applyReference(t, op, weight);
        jobs.push_back(PipelineJob{t.ema, t.source, t.raw ? UpdateOp::kCopyRaw : op, t.name, {}});
      }
      // The owner's one wait before the next update (the Averager's
      // settle()); the sources were free since the last fence() anyway.
      pipeline.wait();
      pipeline.submit(std::move(jobs), {weight}, step);
      pipeline.fence();
      // The optimizer step: a read after the fence would fold NaN in.
      for (Tracked& t : tensors) {
        if (t.raw) {
          t.source.fill_(-1);
        } else {
          t.source.fill_(std::numeric_limits<float>::quiet_NaN());
        }
      }
      if (step % 250 == 0 || step == kSteps) {
        pipeline.wait();
        for (const Tracked& t : tensors) {
          ASSERT_TRUE(sameBytes(t.ema, t.reference)) << where << " step " << step << " " << t.name;
        }
      }
    }
    const offload::PipelineStats stats = pipeline.stats();
    // Staging only where chunks were staged, never over the bound
    // (update_pipeline.h, "Staging memory").
    if (stats.stagedBytes == 0) {
      EXPECT_EQ(stats.stagingBytes, 0) << where;
    } else {
      EXPECT_GT(stats.stagingBytes, 0) << where;
      EXPECT_LE(stats.stagingBytes, chunkBytes * slots) << where;
    }
    EXPECT_LE(fake.maxQueued(), slots * 8) << where << ": copies are bounded by the slots";
    // Which bytes went through the engine: all, none, or the odd jobs'.
    int64_t oddBytes = 0;
    for (size_t j = 1; j < tensors.size(); j += 2) oddBytes += tensors[j].source.nbytes();
    const int64_t expected = path == Path::kStaged   ? stats.sourceBytes
                             : path == Path::kDirect ? 0
                                                     : oddBytes * kSteps;
    EXPECT_EQ(stats.stagedBytes, expected) << where;
    if (path == Path::kDirect) {
      EXPECT_EQ(fake.copies(), 0) << where << ": the engine is not used";
    }
  }
}

TEST(UpdatePipelineTest,
     StagedMatchesSynchronousReferenceBitForBitWithSourcesOverwrittenAfterFence) {
  orderingSweep(Path::kStaged, 20261202);
}

TEST(UpdatePipelineTest,
     DirectMatchesSynchronousReferenceBitForBitWithSourcesOverwrittenAfterFence) {
  orderingSweep(Path::kDirect, 20261203);
}

// Direct and staged chunks of one update share the workers and the state
// machine, as a job with device sources with some host sources would.
TEST(UpdatePipelineTest, MixedPathsMatchSynchronousReferenceBitForBit) {
  orderingSweep(Path::kMixed, 20261204);
}

// Staged: small sources in many tiny chunks; the only worker is held, so
// the math cannot run, yet fence() returns as soon as everything has been
// copied.
TEST(UpdatePipelineTest, StagedFenceReturnsBeforeTheMathIsDone) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  UpdatePipeline pipeline(optionsFor(Path::kStaged, pool, engine, 64, 4));
  at::Tensor source = at::full({64}, 3.0f);  // 4 chunks of 16 floats: one per slot
  at::Tensor ema = at::zeros({64});
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  pool.post([released] { released.wait(); });  // the worker is busy elsewhere
  pipeline.submit({PipelineJob{ema, source, UpdateOp::kLerp, "w", {}}}, {0.5f}, 1);
  pipeline.fence();
  EXPECT_TRUE(pipeline.busy()) << "fence waited for the math";
  EXPECT_EQ(ema[0].item<float>(), 0.0f);
  source.fill_(100.0f);  // allowed after the fence
  release.set_value();
  pipeline.wait();
  EXPECT_FALSE(pipeline.busy());
  EXPECT_TRUE(at::equal(ema, at::full({64}, 1.5f)));
  EXPECT_EQ(engine.producerPoints(), 1);
}

// Direct: the math is the read, so fence() waits for it (held worker:
// fence() is still blocked 50 ms later), and when fence() returns the EMA
// is already updated. The engine is never called.
TEST(UpdatePipelineTest, DirectFenceReturnsOnceTheMathHasReadTheSources) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  UpdatePipeline pipeline(optionsFor(Path::kDirect, pool, engine, 64, 4));
  at::Tensor source = at::full({64}, 3.0f);  // 4 chunks of 16 floats
  at::Tensor ema = at::zeros({64});
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  pool.post([released] { released.wait(); });  // the worker is busy elsewhere
  pipeline.submit({PipelineJob{ema, source, UpdateOp::kLerp, "w", {}}}, {0.5f}, 1);
  std::future<void> fenced = std::async(std::launch::async, [&] { pipeline.fence(); });
  EXPECT_EQ(fenced.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "fence returned before the direct chunks were read";
  release.set_value();
  fenced.get();
  EXPECT_TRUE(at::equal(ema, at::full({64}, 1.5f))) << "fence returned before the math";
  source.fill_(100.0f);  // allowed after the fence
  pipeline.wait();
  EXPECT_TRUE(at::equal(ema, at::full({64}, 1.5f)));
  EXPECT_EQ(engine.producerPoints(), 0);
  EXPECT_EQ(engine.copies(), 0);
  EXPECT_EQ(pipeline.stats().stagedBytes, 0);
  EXPECT_EQ(pipeline.stats().sourceBytes, 64 * 4);
}

class UpdatePipelinePathTest : public ::testing::TestWithParam<Path> {};

INSTANTIATE_TEST_SUITE_P(Paths, UpdatePipelinePathTest,
                         ::testing::Values(Path::kStaged, Path::kDirect),
                         [](const ::testing::TestParamInfo<Path>& info) {
                           return std::string(nameOf(info.param));
                         });

TEST_P(UpdatePipelinePathTest, InjectedFaultIsRethrownFromWaitWithNameAndStep) {
  offload::WorkerPool pool(2);
  testing::FakeCopyEngine engine;
  UpdatePipeline pipeline(optionsFor(GetParam(), pool, engine, 64));
  failpoint::Armed fault("offload.pipeline.chunk",
                         [](int64_t step, int64_t chunk) { return step == 3 && chunk == 2; });
  at::Tensor a = at::ones({16});
  at::Tensor b = at::ones({40});
  at::Tensor emaA = at::zeros({16});
  at::Tensor emaB = at::zeros({40});
  auto jobs = [&] {
    return std::vector<PipelineJob>{{emaA, a, UpdateOp::kCopy, "layer.a", {}},
                                    {emaB, b, UpdateOp::kCopy, "layer.b", {}}};
  };
  pipeline.submit(jobs(), {1.0f}, 1);
  pipeline.wait();
  pipeline.submit(jobs(), {1.0f}, 2);
  pipeline.wait();
  pipeline.submit(jobs(), {1.0f}, 3);
  pipeline.fence();  // never throws: the sources are free either way
  try {
    pipeline.wait();
    FAIL() << "expected the injected fault";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("step 3"), std::string::npos) << message;
    EXPECT_NE(message.find("'layer.b'"), std::string::npos) << message;  // chunk 2 is b's
    EXPECT_NE(message.find("injected fault"), std::string::npos) << message;
  }
  pipeline.wait();  // reported once
  // The pipeline itself stays usable: the next update goes through.
  a.fill_(5.0f);
  b.fill_(6.0f);
  pipeline.submit(jobs(), {1.0f}, 4);
  pipeline.wait();
  EXPECT_TRUE(at::equal(emaA, a));
  EXPECT_TRUE(at::equal(emaB, b));
}

TEST(UpdatePipelineTest, EngineCopyErrorIsRethrownWithTheTensorName) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  engine.failCopy(1);
  UpdatePipeline pipeline(optionsFor(Path::kStaged, pool, engine, 64));
  at::Tensor a = at::ones({40});
  at::Tensor ema = at::zeros({40});
  pipeline.submit({PipelineJob{ema, a, UpdateOp::kCopy, "enc.w", {}}}, {1.0f}, 7);
  try {
    pipeline.wait();
    FAIL() << "expected the copy error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("step 7"), std::string::npos) << message;
    EXPECT_NE(message.find("'enc.w'"), std::string::npos) << message;
    EXPECT_NE(message.find("copy failed"), std::string::npos) << message;
  }
}

TEST(UpdatePipelineTest, CopyToDestinationsConvertsThroughStaging) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  UpdatePipelineOptions options;
  options.chunkBytes = 64;
  options.numSlots = 2;
  options.pool = &pool;
  options.engine = &engine;
  UpdatePipeline pipeline(options);
  std::vector<offload::SwapJob> jobs;
  std::vector<at::Tensor> expected;
  int i = 0;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kFloat}) {
    for (int64_t n : {0, 1, 33, 100}) {
      at::Tensor host = at::rand({n}).mul_(10);
      at::Tensor destination = at::zeros({n}, dtype);
      expected.push_back(host.to(dtype));
      jobs.push_back({host, destination, "d" + std::to_string(i++)});
    }
  }
  // A strided destination takes the ATen path.
  at::Tensor wide = at::zeros({4, 6});
  at::Tensor host = at::rand({4, 3});
  jobs.push_back({host, wide.narrow(1, 0, 3), "strided"});
  expected.push_back(host);
  pipeline.copyTo(jobs);
  for (size_t k = 0; k < jobs.size(); ++k) {
    EXPECT_TRUE(at::equal(jobs[k].destination, expected[k])) << jobs[k].name;
  }
}

TEST(UpdatePipelineTest, RejectsBadOptionsAndJobs) {
  testing::FakeCopyEngine engine;
  offload::WorkerPool none(0);
  offload::WorkerPool one(1);
  auto make = [&](int64_t chunk, int slots, offload::WorkerPool* pool, offload::CopyEngine* e) {
    UpdatePipelineOptions o;
    o.chunkBytes = chunk;
    o.numSlots = slots;
    o.pool = pool;
    o.engine = e;
    UpdatePipeline p(o);
  };
  EXPECT_THROW(make(63, 2, &one, &engine), c10::ValueError);
  EXPECT_THROW(make(64, 0, &one, &engine), c10::ValueError);
  EXPECT_THROW(make(64, 2, &one, nullptr), c10::ValueError);
  EXPECT_THROW(make(64, 2, &none, &engine), c10::ValueError);
  UpdatePipelineOptions o;
  o.pool = &one;
  o.engine = &engine;
  o.chunkBytes = 1024;
  UpdatePipeline pipeline(o);
  at::Tensor ema = at::zeros({4});
  EXPECT_THROW(pipeline.submit({{ema, at::zeros({5}), UpdateOp::kLerp, "n", {}}}, {0.5f}, 1),
               c10::ValueError);
  EXPECT_THROW(
      pipeline.submit({{ema, at::zeros({4}, at::kDouble), UpdateOp::kLerp, "d", {}}}, {0.5f}, 1),
      c10::TypeError);
  EXPECT_THROW(pipeline.submit({{ema, at::zeros({2, 2}).t(), UpdateOp::kLerp, "s", {}}}, {0.5f}, 1),
               c10::ValueError);
  EXPECT_THROW(pipeline.submit({{ema, at::zeros({4}), UpdateOp::kLerp, "w", {}}}, {1.5f}, 1),
               c10::ValueError);
  EXPECT_FALSE(pipeline.busy());
}

// Staging comes from the arena once, at the first update that stages, at
// most numSlots x chunkBytes (a model of ~100 chunks: exactly that); later
// updates allocate nothing more there. The direct path stages nothing.
TEST_P(UpdatePipelinePathTest, StagingIsAllocatedOnceAndBoundedByTheOptions) {
  offload::WorkerPool pool(1);
  testing::FakeCopyEngine engine;
  offload::PinnedArena arena;
  UpdatePipelineOptions options = optionsFor(GetParam(), pool, engine, 4096, 3);
  options.arena = &arena;
  UpdatePipeline pipeline(options);
  EXPECT_EQ(arena.usage().bytesInUse, 0) << "nothing before a chunk needs it";
  at::Tensor source = at::ones({100000});  // 400 KB: ~100 chunks
  at::Tensor ema = at::zeros({100000});
  for (int64_t step = 1; step <= 3; ++step) {
    pipeline.submit({PipelineJob{ema, source, UpdateOp::kLerp, "w", {}}}, {0.5f}, step);
    pipeline.wait();
  }
  const int64_t staging = GetParam() == Path::kStaged ? 3 * 4096 : 0;
  EXPECT_EQ(arena.usage().peakBytes, staging);
  EXPECT_EQ(pipeline.stats().stagingBytes, staging);
  EXPECT_EQ(pipeline.stats().chunks, 3 * ((100000 * 4 + 4095) / 4096));
  EXPECT_EQ(pipeline.stats().sourceBytes, 3 * 400000);
  EXPECT_EQ(pipeline.stats().stagedBytes, GetParam() == Path::kStaged ? 3 * 400000 : 0);
  EXPECT_FLOAT_EQ(ema[0].item<float>(), 0.875f);
}

}  // namespace
}  // namespace shardema
