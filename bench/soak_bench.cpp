// soak_bench: many small updates in a row, for what a long run shows and a
// short benchmark does not: memory that grows per update (a leak in the
// pipeline's hand-offs, the pool's queue or the staging slots) and the
// fixed cost per tensor of one update, against ATen's peer (one lerp_ per
// tensor, synchronous).
//
// Soak/Averager: --soak_cycles (100 000) update()+fence() cycles of an
// Averager (pinned host, the default) over --soak_tensors (500) tensors of
// --soak_elements (256) floats. Counters: rss_start_MiB (after the first
// 100 cycles, so one-off allocations are in), rss_end_MiB, rss_growth_MiB
// and us_per_tensor (wall time / cycles / tensors).
// Soak/ATenLerp: the same tensors, lerp_ into fp32 EMAs, a tenth of the
// cycles (its cost per tensor does not depend on how many); us_per_tensor.
// Not a test: scripts/bench.sh runs it and prints the table.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "build_type_warning.h"
#include "shardema/averager.h"

namespace {

int64_t flagCycles = 100000;
int64_t flagTensors = 500;
int64_t flagElements = 256;

// Resident set size of this process in MiB, from /proc/self/status.
double rssMiB() {
  FILE* status = std::fopen("/proc/self/status", "r");
  if (status == nullptr) return -1.0;
  char line[256];
  double kib = -1.0;
  while (std::fgets(line, sizeof line, status) != nullptr) {
    if (std::strncmp(line, "VmRSS:", 6) == 0) kib = std::strtod(line + 6, nullptr);
  }
  std::fclose(status);
  return kib / 1024.0;
}

std::vector<shardema::TrackedTensor> model() {
  std::vector<shardema::TrackedTensor> tracked;
  for (int64_t i = 0; i < flagTensors; ++i) {
    tracked.push_back({"layer" + std::to_string(i) + ".weight", at::rand({flagElements})});
  }
  return tracked;
}

void soakAverager(benchmark::State& state) {
  shardema::AveragerOptions options;
  options.schedule = shardema::DecaySchedule::constant({0.999});
  shardema::Averager averager(model(), options);
  for (auto _ : state) {
    int64_t step = 0;
    const int64_t warm = std::min<int64_t>(100, flagCycles);
    for (; step < warm; ++step) {
      averager.update(step + 1);
      averager.fence();
    }
    averager.wait();
    const double rssStart = rssMiB();
    const auto start = std::chrono::steady_clock::now();
    for (; step < flagCycles; ++step) {
      averager.update(step + 1);
      averager.fence();
    }
    averager.wait();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double rssEnd = rssMiB();
    state.SetIterationTime(seconds);
    state.counters["rss_start_MiB"] = rssStart;
    state.counters["rss_end_MiB"] = rssEnd;
    state.counters["rss_growth_MiB"] = rssEnd - rssStart;
    state.counters["us_per_tensor"] =
        seconds * 1e6 / static_cast<double>((flagCycles - warm) * flagTensors);
    state.counters["cycles"] = static_cast<double>(flagCycles - warm);
  }
}

void soakATenLerp(benchmark::State& state) {
  std::vector<shardema::TrackedTensor> tracked = model();
  std::vector<at::Tensor> emas;
  for (const auto& t : tracked) emas.push_back(t.source.clone());
  const int64_t cycles = std::max<int64_t>(1, flagCycles / 10);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t c = 0; c < cycles; ++c) {
      for (size_t i = 0; i < emas.size(); ++i) emas[i].lerp_(tracked[i].source, 0.001);
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(seconds);
    state.counters["us_per_tensor"] = seconds * 1e6 / static_cast<double>(cycles * flagTensors);
    state.counters["cycles"] = static_cast<double>(cycles);
  }
}

// --soak_cycles=N, --soak_tensors=N, --soak_elements=N; the rest goes to
// Google Benchmark.
void parseFlags(int* argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* name, int64_t* out) {
      const std::string prefix = std::string("--") + name + "=";
      if (arg.rfind(prefix, 0) != 0) return false;
      *out = std::stoll(arg.substr(prefix.size()));
      return true;
    };
    if (value("soak_cycles", &flagCycles) || value("soak_tensors", &flagTensors) ||
        value("soak_elements", &flagElements)) {
      continue;
    }
    argv[kept++] = argv[i];
  }
  *argc = kept;
}

}  // namespace

int main(int argc, char** argv) {
  parseFlags(&argc, argv);
  shardema::bench::warnIfUnoptimised("soak_bench");
  benchmark::RegisterBenchmark("Soak/Averager", soakAverager)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kSecond);
  benchmark::RegisterBenchmark("Soak/ATenLerp", soakATenLerp)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kSecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
