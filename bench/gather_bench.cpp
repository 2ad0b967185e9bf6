// gather_bench: gatherFull (to every rank and to rank 0) and
// gatherStreaming (to every rank) against a plain c10d/Gloo all-gather of
// the same bytes, in the same run. Ranks are threads of this process, each
// with its own Gloo group over loopback.
//
// Rates (nccl-tests, doc/PERFORMANCE.md): S = bytes of the full model, t =
// time of one operation.
//   algbw = S / t
//   AllGather: busbw = algbw * (n - 1) / n   (each rank receives (n-1)/n of S)
//   Gather:    busbw = algbw * (n - 1) / n   (the root receives (n-1)/n of S;
//              nccl-tests' gather uses the same factor)
// frac_of_allgather = busbw / busbw of the plain all-gather (target >= 0.8).
//
// Sweep: ranks 1..4; S = max/256 .. max, x4 apart (--gather_max_kib=N,
// default 64 MiB: 256 KiB .. 64 MiB); 1 or 16 tensors. ranks:1 is kept on
// purpose although nothing crosses ranks there: busbw is 0 by the formula,
// but algbw and frac_of_allgather (then a ratio of algbw) show what the
// gather costs over the plain all-gather's local copy, i.e. our fixed
// overhead. Peak memory, 4 ranks at 64 MiB: about 4 x 2.5 x S = 640 MiB.
//
// Like with like: every timed iteration runs the plain all-gather and then
// the operation, on the same communicators, both warmed up by one untimed
// pair, and each reports the median of its times. (Timing them in separate
// benchmarks, seconds apart, let the load of this shared 2-core machine
// swing the ratio by 2x either way.) The plain all-gather reuses one output
// buffer; so does GatherStreamingToAll, whose sink copies every piece into
// preallocated full tensors. gatherFull must return fresh tensors, so it
// also pays their allocation and first touch (page faults) every call: its
// ratio is the conservative one.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "shardema/shard/communicator.h"
#include "shardema/shard/gather.h"

namespace {

using namespace shardema::shard;
using Clock = std::chrono::steady_clock;

enum Op { kToAll = 1, kToRoot = 2, kStreamToAll = 3 };

int64_t gMaxKib = 64 << 10;
constexpr int64_t kMaxTensors = 16;

// `tensors` fp32 tensors of S bytes in all, FSDP2-sharded over n ranks.
ShardLayout modelLayout(int64_t bytes, int64_t tensors, int64_t n) {
  ShardLayout layout;
  for (int64_t i = 0; i < tensors; ++i) {
    layout.specs.push_back(fsdp2Spec("layer" + std::to_string(i) + ".weight",
                                     {bytes / 4 / tensors / 256, 256}, at::kFloat, n));
  }
  return layout;
}

struct Times {
  std::vector<double> plain;
  std::vector<double> op;
};

double secondsOf(Communicator& comm, const std::function<void()>& body) {
  comm.barrier("bench start");
  const auto start = Clock::now();
  body();
  comm.barrier("bench end");  // so the time covers every rank's part
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One rank's loop: `iterations` timed pairs (plain all-gather, operation)
// after one untimed pair.
Times rankLoop(Communicator& comm, Op op, const ShardLayout& layout, int64_t bytes,
               int64_t iterations) {
  const int64_t n = comm.worldSize();
  std::vector<at::Tensor> locals;
  std::vector<at::Tensor> outputs;  // kStreamToAll's preallocated results
  for (const ShardSpec& spec : layout.specs) {
    locals.push_back(at::ones({spec.rangeOf(comm.rank()).size()}));
    outputs.push_back(op == kStreamToAll ? at::zeros({spec.numel()}) : at::Tensor());
  }
  at::Tensor piece = at::ones({bytes / n}, at::kByte);
  at::Tensor all = at::empty({bytes / n * n}, at::kByte);
  GatherOptions options;
  options.root = op == kToRoot ? 0 : -1;
  const PieceSink sink = [&](const ShardSpec& spec, int64_t offset, const at::Tensor& p) {
    outputs[static_cast<size_t>(&spec - layout.specs.data())].narrow(0, offset, p.numel()).copy_(p);
  };
  const auto plain = [&] { comm.allGather(piece, all, "plain all-gather"); };
  const auto operation = [&] {
    if (op == kStreamToAll) {
      gatherStreaming(comm, layout, locals, sink, options);
    } else {
      benchmark::DoNotOptimize(gatherFull(comm, layout, locals, options));
    }
  };
  Times times;
  for (int64_t i = -1; i < iterations; ++i) {  // i = -1: warm-up
    const double p = secondsOf(comm, plain);
    const double o = secondsOf(comm, operation);
    if (i >= 0) {
      times.plain.push_back(p);
      times.op.push_back(o);
    }
  }
  return times;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t m = values.size() / 2;
  return values.size() % 2 ? values[m] : (values[m - 1] + values[m]) / 2;
}

// Ranks as threads of one process: turn off c10d's flight recorder, whose
// first record of each group races across threads (tests/support/
// thread_ranks.h says where); read once, when the first group is made.
const bool kFlightRecorderOff = setenv("TORCH_FR_BUFFER_SIZE", "0", 1) == 0;

void BM_Gather(benchmark::State& state) {
  const Op op = static_cast<Op>(state.range(0));
  const int64_t n = state.range(1);
  const int64_t bytes = state.range(2) << 10;
  const ShardLayout layout = modelLayout(bytes, state.range(3), n);
  const int64_t iterations = state.max_iterations;
  auto store = c10::make_intrusive<c10d::HashStore>();
  CommunicatorOptions options;
  options.glooHostname = "127.0.0.1";
  options.timeout = std::chrono::seconds(60);
  std::vector<std::thread> others;
  for (int64_t rank = 1; rank < n; ++rank) {
    others.emplace_back([&, rank] {
      Communicator comm(store, rank, n, options);
      rankLoop(comm, op, layout, bytes, iterations);
    });
  }
  Communicator comm(store, 0, n, options);
  const Times times = rankLoop(comm, op, layout, bytes, iterations);
  for (auto& thread : others) {
    thread.join();
  }
  size_t i = 0;
  for (auto _ : state) {
    state.SetIterationTime(times.op[i++]);
  }
  // n = 1: factor 0, busbw 0 (nothing crosses ranks); algbw still counts.
  const double factor = static_cast<double>(n - 1) / static_cast<double>(n);
  const double algbw = static_cast<double>(bytes) / median(times.op) / 1e9;
  const double plainAlgbw = static_cast<double>(bytes / n * n) / median(times.plain) / 1e9;
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * factor;
  state.counters["plain_busbw_GBps"] = plainAlgbw * factor;
  state.counters["frac_of_allgather"] = algbw / plainAlgbw;
  state.counters["ranks"] = static_cast<double>(n);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.SetBytesProcessed(bytes * state.iterations());
}

void registerAll() {
  for (int64_t n = 1; n <= 4; ++n) {
    for (int64_t divisor = 256; divisor >= 1; divisor /= 4) {
      const int64_t kib = gMaxKib / divisor;
      for (int64_t op : {kToAll, kStreamToAll, kToRoot}) {
        for (int64_t tensors : {int64_t{1}, kMaxTensors}) {
          const char* name = op == kToAll         ? "GatherFullToAll"
                             : op == kStreamToAll ? "GatherStreamingToAll"
                                                  : "GatherFullToRoot";
          benchmark::RegisterBenchmark(name, BM_Gather)
              ->Args({op, n, kib, tensors})
              ->ArgNames({"op", "ranks", "KiB", "tensors"})
              ->Iterations(kib >= 64 << 10   ? 3
                           : kib >= 16 << 10 ? 5
                                             : 9)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
}

}  // namespace

// Removes --gather_max_kib=N from argv (Google Benchmark rejects flags it
// does not know); false after printing why when it is invalid.
bool takeMaxKibFlag(int& argc, char** argv) {
  const char* prefix = "--gather_max_kib=";
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix, std::strlen(prefix)) == 0) {
      gMaxKib = std::atoll(argv[i] + std::strlen(prefix));
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  // The smallest size (max/256) must give each of 16 tensors one 1 KiB row.
  if (gMaxKib < 256 * kMaxTensors) {
    std::fprintf(stderr, "gather_bench: --gather_max_kib must be >= %lld\n",
                 static_cast<long long>(256 * kMaxTensors));
    return false;
  }
  return true;
}

int main(int argc, char** argv) {
  if (!takeMaxKibFlag(argc, argv)) {
    return 1;
  }
#ifdef SHARDEMA_BUILD_TYPE
  if (std::string(SHARDEMA_BUILD_TYPE) != "Release") {
    std::fprintf(stderr, "gather_bench: built as '%s', not Release: figures are not meaningful\n",
                 SHARDEMA_BUILD_TYPE);
  }
#endif
  registerAll();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
