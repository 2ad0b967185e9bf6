// UpdatePipeline: the math of a landed staged chunk is cut into parts, one
// worker task each, when the pool has more workers than staging slots. The
// pipeline owns the threads and hands each part to one; the kernels never
// spread work themselves, so nothing nests inside a worker. The parts must
// add up to the serial update bit for bit (raw copies once), and a failure
// in parts of a chunk must fail the update once, naming the chunk's tensor.
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardema/core/failpoint.h"
#include "shardema/core/update_kernels.h"
#include "shardema/offload/detail/host_copy_engine.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"
#include "support/same_bytes.h"

namespace shardema::offload {
namespace {

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && testing::sameBytes(a.data_ptr(), b.data_ptr(), a.nbytes());
}

SourceType typeOf(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat      ? SourceType::kFloat32
         : t.scalar_type() == at::kBFloat16 ? SourceType::kBFloat16
                                            : SourceType::kFloat16;
}

// Averaged sources of three dtypes (the float32 one spans several 1 MiB
// chunks, so several chunks are in parts) and one raw integer copy, with
// `profiles` EMAs each, checked against the serial kernels.
struct Model {
  explicit Model(int profiles) {
    for (auto [n, dtype] : {std::pair<int64_t, at::ScalarType>{700000, at::kFloat},
                            {300000, at::kBFloat16},
                            {5000, at::kHalf}}) {
      sources.push_back(at::zeros({n}, dtype));
      emas.emplace_back();
      references.emplace_back();
      for (int p = 0; p < profiles; ++p) {
        emas.back().push_back(at::rand({n}));
        references.back().push_back(emas.back().back().clone());
      }
    }
    rawSource = at::zeros({1000}, at::kLong);
    raw = at::zeros({1000}, at::kLong);
  }

  void newSources(int64_t step) {
    for (at::Tensor& s : sources) s.copy_(at::rand(s.sizes()).mul_(static_cast<double>(step)));
    rawSource.copy_(at::randint(1 << 20, {1000}, at::kLong));
  }

  std::vector<PipelineJob> jobs() const {
    std::vector<PipelineJob> out;
    for (size_t t = 0; t < sources.size(); ++t) {
      PipelineJob job{emas[t][0], sources[t], UpdateOp::kLerp, "w" + std::to_string(t), {}};
      job.moreEmas.assign(emas[t].begin() + 1, emas[t].end());
      out.push_back(job);
    }
    out.push_back({raw, rawSource, UpdateOp::kCopyRaw, "count", {}});
    return out;
  }

  void updateReferences(const std::vector<float>& weights) {
    for (size_t t = 0; t < sources.size(); ++t) {
      for (size_t p = 0; p < weights.size(); ++p) {
        updateSpans({{references[t][p].data_ptr<float>(), sources[t].data_ptr(),
                      typeOf(sources[t]), sources[t].numel(), UpdateOp::kLerp}},
                    weights[p]);
      }
    }
  }

  std::vector<at::Tensor> sources;
  std::vector<std::vector<at::Tensor>> emas, references;
  at::Tensor rawSource, raw;
};

UpdatePipelineOptions partsOptions(WorkerPool& pool, CopyEngine& engine) {
  UpdatePipelineOptions options;
  options.pool = &pool;
  options.engine = &engine;
  options.stageHostSources = true;
  options.numSlots = 1;  // four workers per slot: up to four parts a chunk
  options.chunkBytes = int64_t{1} << 20;
  return options;
}

TEST(UpdatePipelinePartsTest, StagedChunksInPartsMatchTheSerialKernelsBitForBit) {
  for (const std::vector<float>& weights :
       {std::vector<float>{0.25f}, std::vector<float>{0.25f, 0.0625f, 1.0f}}) {
    WorkerPool pool(4);
    HostCopyEngine engine;
    UpdatePipeline pipeline(partsOptions(pool, engine));
    Model m(static_cast<int>(weights.size()));
    for (int64_t step = 1; step <= 3; ++step) {
      m.newSources(step);
      pipeline.submit(m.jobs(), weights, step);
      pipeline.wait();
      m.updateReferences(weights);
      for (size_t t = 0; t < m.sources.size(); ++t) {
        for (size_t p = 0; p < weights.size(); ++p) {
          ASSERT_TRUE(sameBytes(m.emas[t][p], m.references[t][p]))
              << weights.size() << " profiles, step " << step << ", tensor " << t << ", profile "
              << p;
        }
      }
      ASSERT_TRUE(sameBytes(m.raw, m.rawSource)) << "step " << step;
    }
    const PipelineStats stats = pipeline.stats();
    EXPECT_GT(stats.stagedParts, stats.chunks)
        << "no chunk was spread over the idle workers (" << stats.chunks << " chunks)";
    EXPECT_LE(stats.stagedParts, 4 * stats.chunks) << "at most the workers per slot";
  }
}

// With as many slots as workers each chunk is one task: the workers are
// busy with the other slots' chunks.
TEST(UpdatePipelinePartsTest, OnePartPerChunkWhenEveryWorkerHasASlot) {
  WorkerPool pool(2);
  HostCopyEngine engine;
  UpdatePipelineOptions options = partsOptions(pool, engine);
  options.numSlots = 2;
  UpdatePipeline pipeline(options);
  Model m(1);
  m.newSources(1);
  pipeline.submit(m.jobs(), {0.5f}, 1);
  pipeline.wait();
  EXPECT_EQ(pipeline.stats().stagedParts, pipeline.stats().chunks);
}

// Every part of the failing chunk throws; the update fails once, naming the
// chunk's tensor and the step, the other parts' errors are dropped, and
// the next update goes through.
TEST(UpdatePipelinePartsTest, AFailureInAChunksPartsIsReportedOnce) {
  WorkerPool pool(4);
  HostCopyEngine engine;
  UpdatePipeline pipeline(partsOptions(pool, engine));
  Model m(1);
  failpoint::Armed fault("offload.pipeline.chunk",
                         [](int64_t step, int64_t chunk) { return step == 2 && chunk == 1; });
  m.newSources(1);
  pipeline.submit(m.jobs(), {1.0f}, 1);
  pipeline.wait();
  m.newSources(2);
  pipeline.submit(m.jobs(), {1.0f}, 2);
  try {
    pipeline.wait();
    FAIL() << "expected the injected fault";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("step 2"), std::string::npos) << message;
    EXPECT_NE(message.find("'w0' (chunk 1 of "), std::string::npos) << message;
    EXPECT_NE(message.find("injected fault"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(pipeline.wait()) << "reported once";
  m.newSources(3);
  for (size_t t = 0; t < m.sources.size(); ++t) m.references[t][0].copy_(m.emas[t][0]);
  pipeline.submit(m.jobs(), {0.5f}, 3);
  pipeline.wait();
  m.updateReferences({0.5f});
  for (size_t t = 0; t < m.sources.size(); ++t) {
    EXPECT_TRUE(sameBytes(m.emas[t][0], m.references[t][0])) << "tensor " << t;
  }
}

}  // namespace
}  // namespace shardema::offload
