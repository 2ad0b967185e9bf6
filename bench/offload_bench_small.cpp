// offload_bench's per-tensor overhead rows: 1000 fp32 tensors of 16
// elements (64 KiB in all, so the math is negligible and what is timed is
// the fixed cost: validation, planning, version counters, hand-offs).
//   small/direct     UpdatePipeline submit + wait, host sources in place
//   small/staged     the same through the host engine and staging
//   small/averager   Averager::update + wait (kPinnedHost, host engine):
//                    what a training loop pays per tensor, the facade's
//                    per-tensor work (actions, snapshots of nothing here,
//                    job building) included
// us_per_tensor = seconds per update / 1000 x 1e6. Target < 0.5.
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <memory>
#include <string>
#include <vector>

#include "offload_bench_model.h"
#include "shardema/averager.h"

namespace offload_bench {
namespace {

using namespace shardema;

constexpr int kSmallTensors = 1000;
constexpr int64_t kSmallElements = 16;

struct SmallModel {
  SmallModel() : pool(1), engine(offload::makeCopyEngine(offload::EngineChoice::kHost)) {
    for (int t = 0; t < kSmallTensors; ++t) {
      sources.push_back(at::full({kSmallElements}, 0.5f + t));
      emas.push_back(at::zeros({kSmallElements}));
      names.push_back("layers." + std::to_string(t) + ".weight");
    }
  }
  std::vector<offload::PipelineJob> jobs() const {
    std::vector<offload::PipelineJob> out;
    out.reserve(kSmallTensors);
    for (int t = 0; t < kSmallTensors; ++t) {
      out.push_back({emas[t], sources[t], UpdateOp::kLerp, names[t], {}});
    }
    return out;
  }
  offload::WorkerPool pool;
  std::unique_ptr<offload::CopyEngine> engine;
  std::vector<at::Tensor> sources, emas;
  std::vector<std::string> names;
};

}  // namespace

// path: 0 direct, 1 staged, 2 Averager.
void BM_SmallTensors(benchmark::State& state, int path) {
  SmallModel m;
  double total = 0;
  if (path < 2) {
    offload::UpdatePipelineOptions options;
    options.pool = &m.pool;
    options.engine = m.engine.get();
    options.stageHostSources = path == 1;
    offload::UpdatePipeline pipeline(options);
    int64_t step = 0;
    for (auto _ : state) {
      const auto start = Clock::now();
      pipeline.submit(m.jobs(), {kWeight}, ++step);
      pipeline.wait();
      total += seconds(Clock::now() - start);
    }
  } else {
    std::vector<TrackedTensor> tracked;
    for (int t = 0; t < kSmallTensors; ++t) {
      tracked.push_back({m.names[t], m.sources[t], TrackRole::kAverage, false});
    }
    AveragerOptions options;
    options.pool = &m.pool;
    options.offload.engine = offload::EngineChoice::kHost;
    options.schedule = DecaySchedule::constant();
    Averager averager(std::move(tracked), options);
    int64_t step = 0;
    for (auto _ : state) {
      const auto start = Clock::now();
      averager.update(++step);
      averager.wait();
      total += seconds(Clock::now() - start);
    }
  }
  const double perUpdate = total / static_cast<double>(state.iterations());
  state.counters["tensors"] = kSmallTensors;
  state.counters["elements_per_tensor"] = kSmallElements;
  state.counters["us_per_update"] = perUpdate * 1e6;
  state.counters["us_per_tensor"] = perUpdate * 1e6 / kSmallTensors;
}

}  // namespace offload_bench
