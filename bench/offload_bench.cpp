// offload_bench: the chunked update pipeline (UpdatePipeline + the host copy
// engine) beside its two limits measured in the same process, and the
// overlap of the EMA with a synthetic training step.
//
// Data: kTensors fp32 (or bf16) source tensors of elements/kTensors each,
// an fp32 EMA in a PinnedArena, staging 2 x 32 MiB (the defaults). Every row
// takes elements as its argument: 5 sizes x4 apart from max/256 to max
// (--offload_elements=N, default 64Mi: 1..256 MiB of fp32 sources), to show
// where fixed costs stop mattering. One model lives at a time.
//   copy/<dtype>      engine copies of every source chunk into the two
//                     staging slots, no math: the engine's raw bandwidth
//   update/<dtype>    updateSpans from the sources into the EMA, no copy, on
//                     one thread (as the pipeline's one math worker): the
//                     CPU update bandwidth
//   pipeline/<dtype>  submit + wait: copy into staging, then the math
//   GBps = source bytes / seconds / 1e9 for every row (the bytes a user's
//   model has), so the rows compare times. Pipeline rows also carry the
//   copy_GBps and update_GBps of the same dtype and size (rows run just
//   before), limit_GBps = their minimum and frac_of_min_limit = GBps / that.
//   overlap           a training step (one thread of in-cache arithmetic,
//                     sized to take about as long as one EMA update) runs
//                     while the EMA of the previous step proceeds in the
//                     background; fence before the "optimizer step".
//                     ratio = wall(step + EMA) / max(step alone, EMA alone),
//                     per round (alone-times re-measured in every round);
//                     median and best reported. 1.0 is perfect overlap,
//                     2.0 none. Target <= 1.1. Rounds: 10, or
//                     --offload_overlap_rounds=N.
// Pinning, so the ratio compares like with like: DESIGN has the training
// step on one core and the EMA on the other. Unpinned, the EMA alone would
// run its copy thread and its math worker on two cores in parallel but get
// only one while the step computes, which puts the ratio near 1.5 by
// construction. So for the whole overlap row (sizing, alone runs and
// overlapped run alike) the calling thread (the training step; it only
// submits and waits for the EMA) is pinned to the first allowed CPU and the
// EMA's threads (the pool's worker and the host engine's copy thread) to the
// second. The running threads are re-pinned from inside a pool task and a
// copy callback, and restored to the original mask afterwards, so the
// copy/update/pipeline rows use every CPU. With fewer than 2 CPUs nothing is
// pinned, a line says so, and counter pinned = 0.
// Counters staging_bytes (numSlots x chunkBytes) and device_bytes (0: the
// EMA and the staging live in host memory) are reported on every row.
#include <ATen/ops/empty.h>
#include <benchmark/benchmark.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardema/offload/copy_engine.h"
#include "shardema/offload/pinned_arena.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/detail/update_kernels.h"
#include "shardema/offload/worker_pool.h"

namespace {

using namespace shardema;
using Clock = std::chrono::steady_clock;

int64_t gMaxElements = int64_t{64} << 20;  // 256 MiB of fp32 sources
int64_t gOverlapRounds = 10;
constexpr int kTensors = 16;
constexpr float kWeight = 0.001f;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Everything a row needs, built once per dtype and shared.
struct Model {
  Model(at::ScalarType dtype, int64_t elements) : pool(1) {
    engine = offload::makeCopyEngine(offload::EngineChoice::kHost);
    for (int t = 0; t < kTensors; ++t) {
      at::Tensor source = arena.allocate({elements / kTensors}, dtype);
      source.fill_(0.25 * (t + 1));
      at::Tensor ema = arena.allocate({elements / kTensors}, at::kFloat);
      ema.fill_(0.0);
      sources.push_back(source);
      emas.push_back(ema);
      sourceBytes += source.nbytes();
    }
    offload::UpdatePipelineOptions options;
    options.pool = &pool;
    options.engine = engine.get();
    options.arena = &arena;
    pipeline = std::make_unique<offload::UpdatePipeline>(options);
  }
  std::vector<offload::PipelineJob> jobs() const {
    std::vector<offload::PipelineJob> out;
    for (int t = 0; t < kTensors; ++t) {
      out.push_back({emas[t], sources[t], UpdateOp::kLerp, false, "t" + std::to_string(t), {}});
    }
    return out;
  }
  void ema() {
    pipeline->submit(jobs(), {kWeight}, ++step);
    pipeline->wait();
  }

  offload::PinnedArena arena;
  // One worker for the math: with the training step on the caller and the
  // engine's copy thread, that is what a 2-core machine can give.
  offload::WorkerPool pool;
  std::unique_ptr<offload::CopyEngine> engine;
  std::unique_ptr<offload::UpdatePipeline> pipeline;
  std::vector<at::Tensor> sources, emas;
  int64_t sourceBytes = 0, step = 0;
};

// The model of the running row. Rows are registered size by size, so this
// rebuilds once per (dtype, size) and only one model's memory is held.
Model& model(at::ScalarType dtype, int64_t elements) {
  static std::unique_ptr<Model> current;
  static std::pair<at::ScalarType, int64_t> currentKey;
  if (!current || currentKey != std::pair{dtype, elements}) {
    current.reset();  // free the previous model before allocating the next
    current = std::make_unique<Model>(dtype, elements);
    currentKey = {dtype, elements};
  }
  return *current;
}

// GB/s of the copy and update rows per (dtype, elements): pipeline limits.
std::map<std::pair<at::ScalarType, int64_t>, double> gCopy, gUpdate;

void counters(benchmark::State& state, const Model& m, double gbps) {
  state.SetBytesProcessed(state.iterations() * m.sourceBytes);
  state.counters["GBps"] = gbps;
  state.counters["staging_bytes"] = static_cast<double>(m.pipeline->stats().stagingBytes);
  state.counters["device_bytes"] = 0;  // host engine and host arena: nothing on a device
}

// Slots from the caller: allocating 64 MiB per pass swamps small sizes.
void copyOnly(Model& m, const std::vector<at::Tensor>& slots) {
  const int64_t chunk = m.pipeline->options().chunkBytes;
  int next = 0;
  for (const at::Tensor& source : m.sources) {
    const auto* bytes = static_cast<const char*>(source.data_ptr());
    for (int64_t off = 0; off < static_cast<int64_t>(source.nbytes()); off += chunk) {
      const auto n = static_cast<size_t>(std::min<int64_t>(chunk, source.nbytes() - off));
      m.engine->copyToHost(bytes + off, slots[next].data_ptr(), n, [](std::exception_ptr) {});
      next ^= 1;
    }
  }
  m.engine->synchronize();
}

void BM_Copy(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  const int64_t chunk = m.pipeline->options().chunkBytes;
  const std::vector<at::Tensor> slots = {m.arena.allocate({chunk}, at::kByte),
                                         m.arena.allocate({chunk}, at::kByte)};
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    copyOnly(m, slots);
    total += seconds(Clock::now() - start);
  }
  const double gbps = m.sourceBytes * state.iterations() / total / 1e9;
  gCopy[{dtype, state.range(0)}] = gbps;
  counters(state, m, gbps);
}

void BM_Update(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  std::vector<UpdateSpan> spans;
  for (int t = 0; t < kTensors; ++t) {
    spans.push_back({m.emas[t].data_ptr<float>(), m.sources[t].data_ptr(),
                     dtype == at::kFloat ? SourceType::kFloat32 : SourceType::kBFloat16,
                     m.emas[t].numel(), UpdateOp::kLerp});
  }
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    updateSpans(spans, kWeight, nullptr);  // one thread, like the pipeline's worker
    total += seconds(Clock::now() - start);
  }
  const double gbps = m.sourceBytes * state.iterations() / total / 1e9;
  gUpdate[{dtype, state.range(0)}] = gbps;
  counters(state, m, gbps);
}

void BM_Pipeline(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    m.ema();
    total += seconds(Clock::now() - start);
  }
  const double gbps = m.sourceBytes * state.iterations() / total / 1e9;
  counters(state, m, gbps);
  const std::pair key{dtype, state.range(0)};
  if (gCopy.count(key) && gUpdate.count(key)) {  // absent when a filter skipped them
    const double limit = std::min(gCopy[key], gUpdate[key]);
    state.counters["copy_GBps"] = gCopy[key];
    state.counters["update_GBps"] = gUpdate[key];
    state.counters["limit_GBps"] = limit;
    state.counters["frac_of_min_limit"] = gbps / limit;
  }
}

// In-cache arithmetic: compute bound, so it leaves the memory bus to the
// EMA, as a matmul-heavy forward/backward would.
float trainingStep(int64_t iterations) {
  float x[64];
  for (int i = 0; i < 64; ++i) x[i] = 1.0f + i * 1e-3f;
  for (int64_t it = 0; it < iterations; ++it) {
    for (float& v : x) v = v * 0.999f + 0.001f;
  }
  float sum = 0;
  for (float v : x) sum += v;
  return sum;
}

double timeStep(int64_t iterations) {
  const auto start = Clock::now();
  benchmark::DoNotOptimize(trainingStep(iterations));
  return seconds(Clock::now() - start);
}

// CPU pinning of the overlap rows (see the file comment).
void pinThisThread(const cpu_set_t& set) {
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

cpu_set_t singleCpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return set;
}

// Re-pins the model's running EMA threads: the pool's one worker through a
// task, the engine's copy thread through a copy callback (short, no engine
// call, as the seam requires).
void pinEmaThreads(Model& m, const cpu_set_t& set) {
  std::promise<void> pinned;
  m.pool.post([&] {
    pinThisThread(set);
    pinned.set_value();
  });
  pinned.get_future().wait();
  char from = 0, to = 0;
  m.engine->copyToHost(&from, &to, 1, [&set](std::exception_ptr) { pinThisThread(set); });
  m.engine->synchronize();
}

// Step on the first allowed CPU, EMA on the second, for one scope.
class OverlapPinning {
 public:
  explicit OverlapPinning(Model& m) : model_(m) {
    sched_getaffinity(0, sizeof(original_), &original_);
    std::vector<int> cpus;
    for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c) {
      if (CPU_ISSET(c, &original_)) cpus.push_back(c);
    }
    if (cpus.size() < 2) {
      std::fprintf(stderr,
                   "offload_bench: only %d CPU available: the overlap rows run unpinned "
                   "(step and EMA share it)\n",
                   CPU_COUNT(&original_));
      return;
    }
    pinned_ = true;
    pinEmaThreads(model_, singleCpu(cpus[1]));
    pinThisThread(singleCpu(cpus[0]));
  }
  ~OverlapPinning() {
    if (!pinned_) return;
    pinThisThread(original_);
    pinEmaThreads(model_, original_);
  }
  bool pinned() const { return pinned_; }

 private:
  Model& model_;
  cpu_set_t original_;
  bool pinned_ = false;
};

// One round: the step alone, the EMA alone, then both as a training loop
// runs them. Alone-times are taken inside every round, so load that other
// processes put on this (shared) machine hits all three alike.
struct Round {
  double step = 0, ema = 0, wall = 0, fenceWait = 0;
  double stepOverlapped = 0;  // the step's own time while the EMA ran
};

Round overlapRound(Model& m, int64_t iterations) {
  Round r;
  r.step = timeStep(iterations);
  auto start = Clock::now();
  m.ema();
  r.ema = seconds(Clock::now() - start);
  // Steady state: the update of step t runs while step t+1 computes; the
  // fence sits right before step t+1's optimizer step.
  start = Clock::now();
  m.pipeline->submit(m.jobs(), {kWeight}, ++m.step);
  benchmark::DoNotOptimize(trainingStep(iterations));
  r.stepOverlapped = seconds(Clock::now() - start);
  m.pipeline->fence();
  m.pipeline->wait();  // the next update would wait here anyway
  r.wall = seconds(Clock::now() - start);
  r.fenceWait = m.pipeline->stats().lastFenceWaitSeconds;
  return r;
}

void BM_Overlap(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  const OverlapPinning pinning(m);
  // Size the step to the EMA, both measured now on this machine.
  m.ema();
  const auto emaStart = Clock::now();
  m.ema();
  const double emaAlone = seconds(Clock::now() - emaStart);
  const int64_t probeIterations = 1 << 20;
  const double probe = timeStep(probeIterations);
  const auto iterations =
      std::max<int64_t>(1, static_cast<int64_t>(probeIterations * emaAlone / probe));
  std::vector<Round> rounds;
  for (auto _ : state) rounds.push_back(overlapRound(m, iterations));
  std::vector<double> ratios;
  for (const Round& r : rounds) ratios.push_back(r.wall / std::max(r.step, r.ema));
  std::sort(ratios.begin(), ratios.end());
  const Round& mid = rounds[rounds.size() / 2];
  state.SetBytesProcessed(state.iterations() * m.sourceBytes);
  state.counters["step_ms"] = mid.step * 1e3;
  state.counters["ema_ms"] = mid.ema * 1e3;
  state.counters["wall_ms"] = mid.wall * 1e3;
  // Which side the overlap slowed: step_overlapped_ms > step_ms means the
  // two cores interfere (shared caches, memory bus, or vCPUs that are
  // hyperthreads of one host core).
  state.counters["step_overlapped_ms"] = mid.stepOverlapped * 1e3;
  state.counters["fence_wait_ms"] = mid.fenceWait * 1e3;
  state.counters["ratio_median"] = ratios[ratios.size() / 2];
  state.counters["ratio_best"] = ratios.front();
  state.counters["staging_bytes"] = static_cast<double>(m.pipeline->stats().stagingBytes);
  state.counters["device_bytes"] = 0;
  state.counters["pinned"] = pinning.pinned() ? 1 : 0;
}

}  // namespace

// Removes our --offload_* flags from argv (Google Benchmark rejects flags
// it does not know); false after printing why when one is invalid.
bool takeOwnFlags(int& argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto valueOf = [&](const std::string& prefix) {
      return arg.rfind(prefix, 0) == 0 ? std::atoll(arg.c_str() + prefix.size()) : -1;
    };
    if (const int64_t n = valueOf("--offload_elements="); n != -1) gMaxElements = n;
    else if (const int64_t r = valueOf("--offload_overlap_rounds="); r != -1) gOverlapRounds = r;
    else argv[out++] = argv[i];
  }
  argc = out;
  // The smallest size (max/256) must still give every tensor an element.
  if (gMaxElements < 256 * kTensors || gOverlapRounds < 1) {
    std::fprintf(stderr, "offload_bench: need elements >= %d, rounds >= 1\n", 256 * kTensors);
    return false;
  }
  return true;
}

int main(int argc, char** argv) {
  if (!takeOwnFlags(argc, argv)) return 1;
#if !defined(__OPTIMIZE__)
  std::fprintf(stderr, "offload_bench: built without optimisation (%s); numbers are not "
                       "representative\n", SHARDEMA_BUILD_TYPE);
#endif
  // Size by size, the four rows of one size together: the pipeline row
  // reads the copy and update rates just measured, and model() keeps one.
  for (auto [dtype, name] : {std::pair{at::kFloat, "f32"}, std::pair{at::kBFloat16, "bf16"}}) {
    const std::string n = name;
    for (int64_t divisor = 256; divisor >= 1; divisor /= 4) {
      const int64_t elements = gMaxElements / divisor / kTensors * kTensors;
      for (auto [row, fn] : {std::pair{"copy/", BM_Copy}, std::pair{"update/", BM_Update},
                             std::pair{"pipeline/", BM_Pipeline}, std::pair{"overlap/", BM_Overlap}}) {
        auto* b = benchmark::RegisterBenchmark((row + n).c_str(), fn, dtype)->Arg(elements);
        b->ArgName("elements")->UseRealTime()->Unit(benchmark::kMillisecond);
        if (fn == BM_Overlap) b->Iterations(gOverlapRounds);
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
