// UpdatePipeline's staging memory follows the model (update_pipeline.h,
// "Staging memory"): none for sources read in place, one slot of about the
// model's size for a small staged model, numSlots x chunkBytes at most for
// a large one, allocated at the first update that needs it and never per
// update. The bytes are counted twice: by PipelineStats::stagingBytes and
// by the arena the slots come from, and the EMA is checked against a
// float64 recomputation so a slot too small for its chunk would show.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "offload/fake_copy_engine.h"
#include "shardema/offload/detail/host_copy_engine.h"
#include "shardema/offload/pinned_arena.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"

namespace shardema {
namespace {

using offload::PipelineJob;
using offload::UpdatePipeline;
using offload::UpdatePipelineOptions;

constexpr int64_t kPage = 4096;

// A model of float32 tensors of the given element counts; source i holds
// i + 1 + k / 1000 at element k, the EMA starts at 0.
struct Model {
  std::vector<at::Tensor> sources;
  std::vector<at::Tensor> emas;
  std::vector<double> reference;  // float64 EMA of every element, in order

  explicit Model(const std::vector<int64_t>& counts) {
    // Filled element by element, not by ATen ops: above 32 Ki elements
    // those run on torch's OpenMP pool, whose uninstrumented barriers
    // ThreadSanitizer reports as races on the caller's stack.
    for (size_t i = 0; i < counts.size(); ++i) {
      at::Tensor source = at::empty({counts[i]}, at::kFloat);
      at::Tensor ema = at::empty({counts[i]}, at::kFloat);
      float* s = source.data_ptr<float>();
      float* e = ema.data_ptr<float>();
      for (int64_t k = 0; k < counts[i]; ++k) {
        s[k] = static_cast<float>(k) / 1000.0f + static_cast<float>(i + 1);
        e[k] = 0.0f;
      }
      sources.push_back(source);
      emas.push_back(ema);
    }
    for (const at::Tensor& s : sources) {
      for (int64_t k = 0; k < s.numel(); ++k) reference.push_back(0.0);
    }
  }

  int64_t bytes() const {
    int64_t total = 0;
    for (const at::Tensor& s : sources) total += s.nbytes();
    return total;
  }

  // One update of every tensor with weight `weight`, waited for; the
  // reference follows in float64.
  void update(UpdatePipeline& pipeline, int64_t step, float weight) {
    std::vector<PipelineJob> jobs;
    for (size_t i = 0; i < sources.size(); ++i) {
      jobs.push_back(
          PipelineJob{emas[i], sources[i], UpdateOp::kLerp, "t" + std::to_string(i), {}});
    }
    pipeline.submit(std::move(jobs), {weight}, step);
    pipeline.wait();
    size_t e = 0;
    for (const at::Tensor& s : sources) {
      const float* p = s.data_ptr<float>();
      for (int64_t k = 0; k < s.numel(); ++k, ++e) {
        reference[e] += static_cast<double>(weight) * (static_cast<double>(p[k]) - reference[e]);
      }
    }
  }

  // The largest error relative to the value (float32 keeps about 6e-8).
  double maxError() const {
    double worst = 0.0;
    size_t e = 0;
    for (const at::Tensor& ema : emas) {
      const float* p = ema.data_ptr<float>();
      for (int64_t k = 0; k < ema.numel(); ++k, ++e) {
        const double error = std::abs(static_cast<double>(p[k]) - reference[e]);
        worst = std::max(worst, error / std::max(1.0, std::abs(reference[e])));
      }
    }
    return worst;
  }
};

UpdatePipelineOptions options(offload::WorkerPool& pool, offload::CopyEngine& engine,
                              offload::PinnedArena& arena, bool staged) {
  UpdatePipelineOptions o;
  o.pool = &pool;
  o.engine = &engine;
  o.arena = &arena;
  o.stageHostSources = staged;
  return o;
}

// A CPU model (host sources, read in place) holds no staging, before or
// after any number of updates.
TEST(UpdatePipelineStagingTest, HostSourcesHoldNoStaging) {
  offload::WorkerPool pool(2);
  offload::HostCopyEngine engine;
  offload::PinnedArena arena;
  Model model({10000, 6000, 500});
  UpdatePipeline pipeline(options(pool, engine, arena, /*staged=*/false));
  EXPECT_EQ(pipeline.stats().stagingBytes, 0);
  for (int64_t step = 1; step <= 5; ++step) model.update(pipeline, step, 0.25f);
  EXPECT_EQ(pipeline.stats().stagingBytes, 0);
  EXPECT_EQ(arena.usage().peakBytes, 0) << "nothing was ever allocated";
  EXPECT_LT(model.maxError(), 1e-6);
}

// A staged model of 66,000 bytes (one chunk of the default 8 MiB) gets one
// slot of its size rounded up to a page, at its first update, kept after.
TEST(UpdatePipelineStagingTest, SmallStagedModelHoldsOneSlotOfItsSize) {
  offload::WorkerPool pool(2);
  offload::HostCopyEngine engine;
  offload::PinnedArena arena;
  // 40,000 + 24,000 + 2,000 bytes: the first two end on 64-byte piece
  // boundaries, so the chunk is exactly the model's 66,000 bytes.
  Model model({10000, 6000, 500});
  ASSERT_EQ(model.bytes(), 66000);
  UpdatePipeline pipeline(options(pool, engine, arena, /*staged=*/true));
  EXPECT_EQ(pipeline.stats().stagingBytes, 0) << "the constructor allocates nothing";
  EXPECT_EQ(arena.usage().bytesInUse, 0);
  const int64_t expected = (66000 + kPage - 1) / kPage * kPage;  // 69,632: 17 pages
  for (int64_t step = 1; step <= 5; ++step) {
    model.update(pipeline, step, 0.25f);
    EXPECT_EQ(pipeline.stats().stagingBytes, expected) << "step " << step;
  }
  EXPECT_EQ(arena.usage().bytesInUse, expected);
  EXPECT_EQ(arena.usage().slabsInUse, 1);
  EXPECT_EQ(arena.usage().peakBytes, expected) << "allocated once, not per update";
  EXPECT_EQ(pipeline.stats().stagedBytes, 5 * model.bytes());
  EXPECT_LT(model.maxError(), 1e-6);
}

// A staged model of more than numSlots chunks holds numSlots x chunkBytes,
// allocated at the first update and never again.
TEST(UpdatePipelineStagingTest, LargeStagedModelHoldsNumSlotsTimesChunkBytes) {
  offload::WorkerPool pool(2);
  offload::HostCopyEngine engine;
  offload::PinnedArena arena;
  UpdatePipelineOptions o = options(pool, engine, arena, /*staged=*/true);
  o.chunkBytes = 64 << 10;
  o.numSlots = 3;
  Model model({200000, 70000, 33});  // about 1 MiB: 17 chunks of 64 KiB
  UpdatePipeline pipeline(o);
  for (int64_t step = 1; step <= 4; ++step) {
    model.update(pipeline, step, 0.5f);
    EXPECT_EQ(pipeline.stats().stagingBytes, 3 * (64 << 10)) << "step " << step;
  }
  EXPECT_EQ(arena.usage().slabsInUse, 3);
  EXPECT_EQ(arena.usage().peakBytes, 3 * (64 << 10)) << "never more, never reallocated";
  EXPECT_LT(model.maxError(), 1e-6);
}

// A model whose staged bytes grow gets its slot replaced by a larger one,
// the old one freed first: never more than numSlots x chunkBytes.
TEST(UpdatePipelineStagingTest, AGrowingModelReplacesItsSlotWithinTheBound) {
  offload::WorkerPool pool(2);
  offload::HostCopyEngine engine;
  offload::PinnedArena arena;
  UpdatePipelineOptions o = options(pool, engine, arena, /*staged=*/true);
  o.chunkBytes = 64 << 10;
  o.numSlots = 2;
  UpdatePipeline pipeline(o);
  Model small({1000});  // 4,000 bytes: one page
  small.update(pipeline, 1, 0.5f);
  EXPECT_EQ(pipeline.stats().stagingBytes, kPage);
  Model larger({5000});  // 20,000 bytes: five pages
  larger.update(pipeline, 2, 0.5f);
  EXPECT_EQ(pipeline.stats().stagingBytes, 5 * kPage);
  EXPECT_EQ(arena.usage().slabsInUse, 1);
  small.update(pipeline, 3, 0.5f);  // a smaller update keeps the larger slot
  EXPECT_EQ(pipeline.stats().stagingBytes, 5 * kPage);
  Model large({50000});  // 200,000 bytes: both slots, each a whole chunk
  large.update(pipeline, 4, 0.5f);
  EXPECT_EQ(pipeline.stats().stagingBytes, 2 * (64 << 10));
  EXPECT_EQ(arena.usage().bytesInUse, 2 * (64 << 10));
  EXPECT_LE(arena.usage().peakBytes, 2 * (64 << 10));
  for (const Model* m : {&small, &larger, &large}) EXPECT_LT(m->maxError(), 1e-6);
}

// An engine whose copies are not on the host's timeline (as CUDA's): a
// swap into a host tensor of another dtype is then staged like a device
// destination. FakeCopyEngine's thread still does the copies.
class OffTimelineEngine : public testing::FakeCopyEngine {
 public:
  bool copiesOnHostTimeline() const override { return false; }
};

// A swap that converts (float32 EMA into bf16 weights) stages through a
// slot of its size only where it must; a host destination with a host
// engine is converted in place, with no staging.
TEST(UpdatePipelineStagingTest, SwapConversionsStageOnlyWhereTheyMust) {
  offload::WorkerPool pool(2);
  offload::PinnedArena arena;
  const at::Tensor ema = at::arange(3000, at::kFloat).div_(7);
  const at::Tensor expected = ema.to(at::kBFloat16);
  {
    offload::HostCopyEngine engine;
    UpdatePipeline pipeline(options(pool, engine, arena, /*staged=*/false));
    at::Tensor weights = at::zeros({3000}, at::kBFloat16);
    pipeline.copyTo({{ema, weights, "w"}});
    EXPECT_TRUE(weights.equal(expected));
    EXPECT_EQ(pipeline.stats().stagingBytes, 0);
  }
  OffTimelineEngine engine;
  UpdatePipeline pipeline(options(pool, engine, arena, /*staged=*/false));
  at::Tensor weights = at::zeros({3000}, at::kBFloat16);
  pipeline.copyTo({{ema, weights, "w"}});
  EXPECT_TRUE(weights.equal(expected));
  EXPECT_EQ(pipeline.stats().stagingBytes, 2 * kPage) << "6,000 bytes of bf16: two pages";
}

}  // namespace
}  // namespace shardema
