// UpdatePipeline::takeJobs() and the checks it keeps per job index: the same
// jobs submitted again give the same EMA as fresh ones (float64 reference),
// a job whose EMA is another tensor than last time at its index is checked
// again (a bad one refused naming it), a source replaced at an index is
// followed (its version counter too: a write to the new one is seen, to the
// old one not), and takeJobs() refuses while an update is in flight.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <future>
#include <string>
#include <vector>

#include "shardema/offload/detail/host_copy_engine.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"

namespace shardema {
namespace {

using offload::PipelineJob;
using offload::UpdatePipeline;
using offload::UpdatePipelineOptions;

struct Fixture {
  offload::HostCopyEngine engine;
  offload::WorkerPool pool{2};
  UpdatePipeline pipeline{options()};

  UpdatePipelineOptions options() {
    UpdatePipelineOptions o;
    o.chunkBytes = 256;  // several chunks per update
    o.numSlots = 2;
    o.engine = &engine;
    o.pool = &pool;
    return o;
  }
};

at::Tensor filled(int64_t n, float value) { return at::full({n}, value, at::kFloat); }

TEST(UpdatePipelineReuseTest, ReusedJobsGiveTheFloat64Ema) {
  Fixture f;
  std::vector<at::Tensor> sources = {filled(100, 1.0f), filled(37, 2.0f)};
  std::vector<at::Tensor> emas = {at::zeros({100}), at::zeros({37})};
  std::vector<double> reference = {0.0, 0.0};
  std::vector<PipelineJob> jobs;
  for (size_t i = 0; i < sources.size(); ++i) {
    jobs.push_back(PipelineJob{emas[i], sources[i], UpdateOp::kLerp, "t" + std::to_string(i)});
  }
  for (int64_t step = 1; step <= 6; ++step) {
    for (size_t i = 0; i < sources.size(); ++i) {
      sources[i].fill_(static_cast<float>(step * (i + 1)));
      reference[i] += 0.25 * (static_cast<double>(step * (i + 1)) - reference[i]);
    }
    f.pipeline.submit(std::move(jobs), {0.25f}, step);
    f.pipeline.wait();
    jobs = f.pipeline.takeJobs();
    ASSERT_EQ(jobs.size(), 2u) << "the jobs come back";
    EXPECT_TRUE(f.pipeline.takeJobs().empty()) << "once";
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    for (int64_t k = 0; k < emas[i].numel(); ++k) {
      EXPECT_NEAR(emas[i][k].item<float>(), reference[i], 1e-5) << i << " " << k;
    }
  }
}

TEST(UpdatePipelineReuseTest, AnotherEmaAtAnIndexIsCheckedAgain) {
  Fixture f;
  const at::Tensor source = filled(64, 1.0f);
  f.pipeline.submit({PipelineJob{at::zeros({64}), source, UpdateOp::kLerp, "w"}}, {0.5f}, 1);
  f.pipeline.wait();
  std::vector<PipelineJob> jobs = f.pipeline.takeJobs();
  // Another tensor at index 0: strided, so the EMA check must run again.
  jobs[0].ema = at::zeros({64, 2}).select(1, 0);
  try {
    f.pipeline.submit(std::move(jobs), {0.5f}, 2);
    FAIL() << "a strided EMA was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("ema of 'w' must be a contiguous CPU tensor"),
              std::string::npos)
        << e.what();
  }
  // Of the wrong size: refused naming both counts.
  try {
    f.pipeline.submit({PipelineJob{at::zeros({63}), source, UpdateOp::kLerp, "w"}}, {0.5f}, 2);
    FAIL() << "an EMA of 63 elements was taken for 64";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("64 source elements but 63 EMA elements"),
              std::string::npos)
        << e.what();
  }
}

TEST(UpdatePipelineReuseTest, AReplacedSourceIsReadAndItsWritesSeen) {
  Fixture f;
  const at::Tensor ema = at::zeros({32});
  const at::Tensor first = filled(32, 1.0f);
  f.pipeline.submit({PipelineJob{ema, first, UpdateOp::kCopy, "w"}}, {1.0f}, 1);
  f.pipeline.wait();
  std::vector<PipelineJob> jobs = f.pipeline.takeJobs();
  const at::Tensor second = filled(32, 5.0f);
  jobs[0].source = second;
  f.pipeline.submit(std::move(jobs), {1.0f}, 2);
  f.pipeline.wait();
  EXPECT_EQ(ema[0].item<float>(), 5.0f) << "the new source was read";
  first.add_(1.0f);  // the old source: no longer the job's
  EXPECT_TRUE(f.pipeline.writtenSinceSubmit().empty());
  second.add_(1.0f);
  EXPECT_EQ(f.pipeline.writtenSinceSubmit(), std::vector<size_t>{0});
}

TEST(UpdatePipelineReuseTest, TakeJobsRefusesWhileAnUpdateIsInFlight) {
  // The staged path with the one worker held: after fence() the copies are
  // done and the math is not, so the update is in flight.
  offload::HostCopyEngine engine;
  offload::WorkerPool pool(1);
  UpdatePipelineOptions options;
  options.chunkBytes = 64;
  options.numSlots = 4;
  options.engine = &engine;
  options.pool = &pool;
  options.stageHostSources = true;
  UpdatePipeline pipeline(options);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  pool.post([released] { released.wait(); });
  pipeline.submit({PipelineJob{at::zeros({64}), filled(64, 1.0f), UpdateOp::kLerp, "w"}}, {0.5f},
                  1);
  pipeline.fence();
  ASSERT_TRUE(pipeline.busy());
  try {
    pipeline.takeJobs();
    ADD_FAILURE() << "takeJobs() took the jobs of an update in flight";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("takeJobs: the update of step 1 has not been waited"),
              std::string::npos)
        << e.what();
  }
  release.set_value();
  pipeline.wait();
  EXPECT_EQ(pipeline.takeJobs().size(), 1u);
}

}  // namespace
}  // namespace shardema
