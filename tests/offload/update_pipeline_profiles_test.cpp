// UpdatePipeline with several EMA profiles per source (post-hoc EMA): one
// pass, staged or direct, updates every profile, bit-identical to updating
// each profile alone with the plain kernels, under random chunk sizes,
// slots and workers. Runs under ThreadSanitizer too.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "shardema/core/update_kernels.h"
#include "shardema/offload/detail/host_copy_engine.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"
#include "support/same_bytes.h"

namespace shardema {
namespace {

using offload::PipelineJob;
using offload::UpdatePipeline;
using offload::UpdatePipelineOptions;

constexpr int64_t kSteps = 200;

struct ProfiledTensor {
  at::Tensor source;
  std::vector<at::Tensor> emas;        // what the pipeline writes, one per profile
  std::vector<at::Tensor> references;  // plain lerpRange per profile, on the caller
  at::Tensor raw;                      // an int64 copy riding along
  at::Tensor rawSource;
};

SourceType typeOf(at::ScalarType dtype) {
  return dtype == at::kFloat      ? SourceType::kFloat32
         : dtype == at::kBFloat16 ? SourceType::kBFloat16
                                  : SourceType::kFloat16;
}

void fill(const at::Tensor& t, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  at::Tensor fp32 = at::empty({t.numel()}, at::kFloat);
  for (int64_t i = 0; i < fp32.numel(); ++i) fp32.data_ptr<float>()[i] = value(rng);
  t.copy_(fp32.view(t.sizes()));
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && testing::sameBytes(a.data_ptr(), b.data_ptr(), a.nbytes());
}

TEST(UpdatePipelineProfilesTest, OnePassEqualsEachProfileAlone) {
  std::mt19937 rng(20261203);
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (int config = 0; config < 6; ++config) {
    const int profiles = 2 + config % 3;  // 2, 3, 4
    offload::WorkerPool pool(1 + static_cast<int>(rng() % 2));
    offload::HostCopyEngine engine;
    UpdatePipelineOptions options;
    options.chunkBytes = 64 * (1 + static_cast<int64_t>(rng() % 40));
    options.numSlots = 1 + static_cast<int>(rng() % 3);
    options.pool = &pool;
    options.engine = &engine;
    // Even configurations stage the host sources, odd ones read them in place.
    options.stageHostSources = config % 2 == 0;
    UpdatePipeline pipeline(options);
    std::vector<ProfiledTensor> tensors;
    for (int t = 0; t < 3; ++t) {
      ProfiledTensor p;
      p.source = at::empty({1 + static_cast<int64_t>(rng() % 700)}, dtypes[(config + t) % 3]);
      for (int k = 0; k < profiles; ++k) {
        p.emas.push_back(at::zeros({p.source.numel()}, at::kFloat));
        p.references.push_back(at::zeros({p.source.numel()}, at::kFloat));
      }
      p.rawSource = at::zeros({5}, at::kLong);
      p.raw = at::zeros({5}, at::kLong);
      tensors.push_back(p);
    }
    for (int64_t step = 1; step <= kSteps; ++step) {
      std::vector<float> weights;
      for (int k = 0; k < profiles; ++k) weights.push_back(1.0f / static_cast<float>(step + k));
      const UpdateOp op = step == 1 ? UpdateOp::kCopy : UpdateOp::kLerp;
      std::vector<PipelineJob> jobs;
      for (size_t t = 0; t < tensors.size(); ++t) {
        ProfiledTensor& p = tensors[t];
        fill(p.source, rng);
        p.rawSource.fill_(step * 10 + static_cast<int64_t>(t));
        for (int k = 0; k < profiles; ++k) {
          float* ref = p.references[k].data_ptr<float>();
          const SourceType type = typeOf(p.source.scalar_type());
          if (op == UpdateOp::kCopy) {
            copyRange(ref, p.source.data_ptr(), type, p.source.numel());
          } else {
            lerpRange(ref, p.source.data_ptr(), type, p.source.numel(), weights[k]);
          }
        }
        PipelineJob job;
        job.ema = p.emas[0];
        job.moreEmas.assign(p.emas.begin() + 1, p.emas.end());
        job.source = p.source;
        job.op = op;
        job.name = "t" + std::to_string(t);
        jobs.push_back(job);
        PipelineJob raw;
        raw.ema = p.raw;
        raw.source = p.rawSource;
        raw.op = UpdateOp::kCopyRaw;
        raw.name = "raw" + std::to_string(t);
        jobs.push_back(raw);
      }
      pipeline.wait();  // the owner's one wait before each update
      pipeline.submit(jobs, weights, step);
      pipeline.fence();  // sources are rewritten at the next step
    }
    pipeline.wait();
    for (size_t t = 0; t < tensors.size(); ++t) {
      for (int k = 0; k < profiles; ++k) {
        EXPECT_TRUE(sameBytes(tensors[t].emas[k], tensors[t].references[k]))
            << "config " << config << " staged " << options.stageHostSources << " tensor " << t
            << " profile " << k;
      }
      EXPECT_EQ(tensors[t].raw[0].item<int64_t>(), kSteps * 10 + static_cast<int64_t>(t));
    }
    // One read (staged: one copy) per source byte, whatever the number of
    // profiles.
    int64_t sourceBytes = 0;
    for (const ProfiledTensor& p : tensors) sourceBytes += p.source.nbytes() + p.rawSource.nbytes();
    EXPECT_EQ(pipeline.stats().sourceBytes, kSteps * sourceBytes);
    EXPECT_EQ(pipeline.stats().stagedBytes, options.stageHostSources ? kSteps * sourceBytes : 0);
  }
}

TEST(UpdatePipelineProfilesTest, MismatchedProfilesAreRefused) {
  offload::WorkerPool pool(1);
  offload::HostCopyEngine engine;
  UpdatePipelineOptions options;
  options.pool = &pool;
  options.engine = &engine;
  options.chunkBytes = 1024;
  UpdatePipeline pipeline(options);
  PipelineJob job;
  job.source = at::zeros({8}, at::kFloat);
  job.ema = at::zeros({8}, at::kFloat);
  job.moreEmas = {at::zeros({8}, at::kFloat)};
  job.name = "w";
  EXPECT_THROW(pipeline.submit({job}, std::vector<float>{0.5f, 0.5f, 0.5f}, 1), c10::ValueError);
  EXPECT_THROW(pipeline.submit({job}, std::vector<float>{0.5f, 1.5f}, 1), c10::ValueError);
  EXPECT_THROW(pipeline.submit({job}, std::vector<float>{}, 1), c10::ValueError);
  PipelineJob wrongSize = job;
  wrongSize.moreEmas = {at::zeros({7}, at::kFloat)};
  EXPECT_THROW(pipeline.submit({wrongSize}, std::vector<float>{0.5f, 0.5f}, 1), c10::ValueError);
  PipelineJob aliased = job;
  aliased.moreEmas = {job.ema};
  EXPECT_THROW(pipeline.submit({aliased}, std::vector<float>{0.5f, 0.5f}, 1), c10::ValueError);
  // The valid form still works after the refusals.
  job.source.fill_(2.0f);
  pipeline.submit({job}, std::vector<float>{0.5f, 0.25f}, 1);
  pipeline.wait();
  EXPECT_EQ(job.ema[0].item<float>(), 1.0f);
  EXPECT_EQ(job.moreEmas[0][0].item<float>(), 0.5f);
}

}  // namespace
}  // namespace shardema
