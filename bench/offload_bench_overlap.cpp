// offload_bench's overlap row: a training step (one thread of in-cache
// arithmetic, sized to take about as long as one EMA update) runs while the
// EMA of the previous step proceeds in the background on the staged path
// (the path device sources take; the host engine's copy stands in for the
// DMA); fence before the "optimizer step". ratio = wall(step + EMA) /
// max(step alone, EMA alone), per round (alone-times re-measured in every
// round); median and best reported. 1.0 is perfect overlap, 2.0 none.
// Target <= 1.1. Rounds: 10, or --offload_overlap_rounds=N.
// Pinning, so the ratio compares like with like: the training step on one
// core and the EMA on the other. Unpinned, the EMA alone would
// run its copy thread and its math worker on two cores in parallel but get
// only one while the step computes, which puts the ratio near 1.5 by
// construction. So for the whole overlap row (sizing, alone runs and
// overlapped run alike) the calling thread (the training step; it only
// submits and waits for the EMA) is pinned to the first allowed CPU and the
// EMA's threads (the pool's worker and the host engine's copy thread) to the
// second. The running threads are re-pinned from inside a pool task and a
// copy callback, and restored to the original mask afterwards, so the other
// rows use every CPU. With fewer than 2 CPUs nothing is pinned, a line says
// so, and counter pinned = 0.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <future>
#include <vector>

#include "offload_bench_model.h"

namespace offload_bench {
namespace {

using namespace shardema;

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
  m.ema(*m.staged);
  r.ema = seconds(Clock::now() - start);
  // Steady state: the update of step t runs while step t+1 computes; the
  // fence sits right before step t+1's optimizer step.
  start = Clock::now();
  m.staged->submit(m.jobs(), {kWeight}, ++m.step);
  benchmark::DoNotOptimize(trainingStep(iterations));
  r.stepOverlapped = seconds(Clock::now() - start);
  m.staged->fence();
  m.staged->wait();  // the next update would wait here anyway
  r.wall = seconds(Clock::now() - start);
  r.fenceWait = m.staged->stats().lastFenceWaitSeconds;
  return r;
}

}  // namespace

void BM_Overlap(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  const OverlapPinning pinning(m);
  // Size the step to the EMA, both measured now on this machine.
  m.ema(*m.staged);
  const auto emaStart = Clock::now();
  m.ema(*m.staged);
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
  state.counters["staging_bytes"] = static_cast<double>(m.staged->stats().stagingBytes);
  state.counters["device_bytes"] = 0;
  state.counters["pinned"] = pinning.pinned() ? 1 : 0;
}

}  // namespace offload_bench
