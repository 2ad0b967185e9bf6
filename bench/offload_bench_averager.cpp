// offload_bench: averager/<dtype> rows. What a user's update() + wait()
// costs over the kernel alone, with host sources (the direct path), on the
// same threads and the same memory:
//   averager/<dtype>  Averager::update + wait over the model's kTensors host
//                     sources (kPinnedHost, host engine, constant decay:
//                     every update lerps), on a WorkerPool of the size the
//                     shared pool gets on this machine (WorkerPool::
//                     sharedPoolSize()). Each pass is paired with one of the
//                     kernel alone: updateOnPool over the same sources into
//                     the Averager's own EMA tensors, split over the same
//                     pool's workers and the calling thread, run before and
//                     after the timed pass in turn so neither side always
//                     meets the other's cache leftovers.
//   GBps (source bytes), kernel_GBps, frac_of_kernel = kernel time /
//   update time (issue 22's target: >= 0.9), threads (workers + caller).
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <vector>

#include "offload_bench_model.h"
#include "shardema/averager.h"
#include "shardema/offload/parallel_update.h"

namespace offload_bench {

using namespace shardema;

namespace {

struct AveragerRig {
  explicit AveragerRig(const Model& m) : pool(offload::WorkerPool::sharedPoolSize()) {
    std::vector<TrackedTensor> tracked;
    for (int t = 0; t < kTensors; ++t) {
      tracked.push_back({"t" + std::to_string(t), m.sources[t], TrackRole::kAverage, false});
    }
    AveragerOptions options;
    options.pool = &pool;
    options.offload.engine = offload::EngineChoice::kHost;
    options.schedule = DecaySchedule::constant({1.0 - kWeight});
    options.copyOnFirstUpdate = false;
    averager = std::make_unique<Averager>(std::move(tracked), options);
    const SourceType type = m.dtype == at::kFloat ? SourceType::kFloat32 : SourceType::kBFloat16;
    for (int t = 0; t < kTensors; ++t) {
      const at::Tensor& ema = averager->ema("t" + std::to_string(t));
      spans.push_back({ema.data_ptr<float>(), m.sources[t].data_ptr(), type, ema.numel(),
                       UpdateOp::kLerp});
    }
  }
  offload::WorkerPool pool;
  std::unique_ptr<Averager> averager;
  std::vector<UpdateSpan> spans;
  int64_t step = 0;
};

}  // namespace

void BM_Averager(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  AveragerRig rig(m);
  const auto kernelAlone = [&] {
    const auto start = Clock::now();
    offload::updateOnPool(rig.pool, rig.spans, static_cast<float>(kWeight));
    return seconds(Clock::now() - start);
  };
  const auto update = [&] {
    rig.averager->update(++rig.step);
    rig.averager->wait();
  };
  update();  // untimed: the EMA's first touch (page faults)
  double total = 0, alone = 0;
  bool kernelFirst = false;
  for (auto _ : state) {
    kernelFirst = !kernelFirst;
    if (kernelFirst) alone += kernelAlone();
    const auto start = Clock::now();
    update();
    const double took = seconds(Clock::now() - start);
    total += took;
    state.SetIterationTime(took);  // the Time column is the update's alone
    if (!kernelFirst) alone += kernelAlone();
  }
  const double bytes = static_cast<double>(m.sourceBytes) * state.iterations();
  state.SetBytesProcessed(state.iterations() * m.sourceBytes);
  state.counters["GBps"] = bytes / total / 1e9;
  state.counters["kernel_GBps"] = bytes / alone / 1e9;
  state.counters["frac_of_kernel"] = alone / total;
  state.counters["threads"] = rig.pool.size() + 1;
}

}  // namespace offload_bench
