// posthoc_bench: post-hoc EMA keeps k profiles (one per sigma_rel) of the
// same weights. Compares updating them in one pass (updateSpansMulti: the
// source read once) with k separate updateSpans passes (source read k times).
//
// Quick full run (well under a minute on a 2-core VM):
//   build/bench/posthoc_bench --benchmark_min_time=0.05
// Elements per profile: 8 Mi by default (64 Mi is the model size of
// interest but too slow on small VMs); change with --posthoc_elements=N.
//
// Rows (threads = pool workers + the caller, as in update_bench):
//   one_pass/<src>/k:<k>      updateSpansMulti over k profiles
//   k_passes/<src>/k:<k>      k calls of updateSpans, one per profile
//   one_pass_size/f32/k:<k>/n:<n>  one pass at 4 sizes spanning 100x:
//                             n = elements x 1/32, 1/4, 1, 3.2 (256 Ki..
//                             25.6 Mi by default), k = 2 and 8
// Counters, bytes counted as the one-pass model moves them for both rows
// (so GBps compares times):
//   bytes_per_elem_model  srcBytes + 8k (read src once, read+write each EMA)
//   GBps                  model bytes / wall seconds / 1e9
//   limit_GBps            paired in-place a[i] += b[i] pass, 12 B/elem,
//                         run right before ours in every iteration (not in
//                         our time) so both see the same neighbour load
//   frac_of_limit         GBps / limit_GBps
//   ns_per_elem           wall ns per source element (all k profiles)
//   speedup_vs_k_passes   (one_pass rows) time of k updateSpans passes,
//                         also run in every iteration, / time of one pass
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "build_type_warning.h"
#include "shardema/core/update_kernels.h"
#include "shardema/offload/parallel_update.h"
#include "shardema/offload/worker_pool.h"

namespace {

using shardema::SourceType;

int64_t gElements = int64_t{8} << 20;
constexpr int kThreads = 2;
constexpr int64_t kPiecesPerThread = 4;  // as offload::updateOnPool splits

shardema::offload::WorkerPool& pool() {
  static shardema::offload::WorkerPool p(kThreads - 1);
  return p;
}

const char* typeName(SourceType t) { return t == SourceType::kFloat32 ? "f32" : "bf16"; }

// k EMAs, one source and the limit pair, n elements each. Values stay in a
// normal range (no subnormal microcode assists).
struct Data {
  std::vector<std::vector<float>> emas;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  std::vector<float> limitA, limitB;
  std::vector<float> weights;
  const void* src(SourceType t) const {
    return t == SourceType::kFloat32 ? static_cast<const void*>(f32.data()) : u16.data();
  }
};

Data makeData(int k, int64_t n, SourceType type) {
  Data d;
  for (int p = 0; p < k; ++p) {
    d.emas.emplace_back(n);
    for (int64_t i = 0; i < n; ++i) {
      d.emas.back()[i] = 0.5f + static_cast<float>((i + p) % 1024) / 4096.0f;
    }
    d.weights.push_back(0.001f * static_cast<float>(p + 1));
  }
  if (type == SourceType::kFloat32) {
    d.f32.resize(n);
    for (int64_t i = 0; i < n; ++i) d.f32[i] = static_cast<float>(i % 777) / 777.0f;
  } else {
    d.u16.resize(n);
    // bf16 2^-15..2, never subnormal.
    for (int64_t i = 0; i < n; ++i) d.u16[i] = static_cast<uint16_t>(0x3800 + i % 0x07ff);
  }
  d.limitA.assign(n, 1.0f);
  d.limitB.assign(n, 0.25f);
  return d;
}

void addInPlace(float* __restrict a, const float* __restrict b, int64_t n, float sign) {
  for (int64_t i = 0; i < n; ++i) {
    a[i] += sign * b[i];
  }
}

// One limit pass split like offload::updateOnPool splits; alternates += and -= so the
// values stay put.
void limitPass(Data& d) {
  static float sign = 1.0f;
  const int64_t n = static_cast<int64_t>(d.limitA.size());
  const int64_t pieces = kThreads * kPiecesPerThread;
  float* a = d.limitA.data();
  const float* b = d.limitB.data();
  pool().parallelFor(pieces, [&](int64_t p) {
    const int64_t begin = n / pieces * p, end = p + 1 == pieces ? n : begin + n / pieces;
    addInPlace(a + begin, b + begin, end - begin, sign);
  });
  sign = -sign;
}

void onePass(Data& d, SourceType type, int64_t n) {
  shardema::MultiUpdateSpan span;
  for (auto& e : d.emas) span.emas.push_back(e.data());
  span.src = d.src(type);
  span.type = type;
  span.count = n;
  shardema::offload::updateOnPool(pool(), {span}, d.weights);
}

void kPasses(Data& d, SourceType type, int64_t n) {
  for (size_t p = 0; p < d.emas.size(); ++p) {
    shardema::UpdateSpan span{d.emas[p].data(), d.src(type), type, n, shardema::UpdateOp::kLerp};
    shardema::offload::updateOnPool(pool(), {span}, d.weights[p]);
  }
}

template <typename F>
double secondsOf(F f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// onePassRow: time updateSpansMulti, pairing a k-pass run for the speedup;
// otherwise time the k passes. Both pair a limit pass per iteration.
void bench(benchmark::State& state, SourceType type, int k, int64_t n, bool onePassRow) {
  Data d = makeData(k, n, type);
  double ours = 0.0, limit = 0.0, other = 0.0;
  for (auto _ : state) {
    limit += secondsOf([&] { limitPass(d); });
    const double s = onePassRow ? secondsOf([&] { onePass(d, type, n); })
                                : secondsOf([&] { kPasses(d, type, n); });
    if (onePassRow) {
      other += secondsOf([&] { kPasses(d, type, n); });
    }
    ours += s;
    state.SetIterationTime(s);
  }
  const double iters = static_cast<double>(state.iterations());
  const double elems = iters * static_cast<double>(n);
  const double bytesPerElem = shardema::sourceTypeSize(type) + 8.0 * k;
  state.SetBytesProcessed(static_cast<int64_t>(bytesPerElem * elems));
  const double gbps = bytesPerElem * elems / ours / 1e9;
  const double limitGbps = 12.0 * elems / limit / 1e9;
  state.counters["bytes_per_elem_model"] = bytesPerElem;
  state.counters["GBps"] = gbps;
  state.counters["limit_GBps"] = limitGbps;
  state.counters["frac_of_limit"] = gbps / limitGbps;
  state.counters["ns_per_elem"] = ours / elems * 1e9;
  if (onePassRow) {
    state.counters["speedup_vs_k_passes"] = other / ours;
  }
}

void registerAll() {
  auto common = [](benchmark::internal::Benchmark* b) {
    b->UseManualTime()->Unit(benchmark::kMillisecond);
  };
  for (SourceType type : {SourceType::kFloat32, SourceType::kBFloat16}) {
    for (int k : {1, 2, 4, 8}) {
      const std::string suffix = std::string("/") + typeName(type) + "/k:" + std::to_string(k);
      common(benchmark::RegisterBenchmark(("one_pass" + suffix).c_str(), bench, type, k, gElements,
                                          true));
      common(benchmark::RegisterBenchmark(("k_passes" + suffix).c_str(), bench, type, k, gElements,
                                          false));
    }
  }
  // 256 Ki .. 25.6 Mi by default: from cache-resident-ish to well past the
  // LLC. Scaled with --posthoc_elements so a quick run stays quick.
  for (int k : {2, 8}) {
    for (double scale : {1.0 / 32, 1.0 / 4, 1.0, 3.2}) {
      const auto n = std::max<int64_t>(1, static_cast<int64_t>(scale * gElements));
      const std::string name =
          "one_pass_size/f32/k:" + std::to_string(k) + "/n:" + std::to_string(n);
      common(benchmark::RegisterBenchmark(name.c_str(), bench, SourceType::kFloat32, k, n, true));
    }
  }
}

// Correctness in the same run: one pass equals k passes bit for bit.
void checkOnePassMatches() {
  const int64_t n = 100003;
  for (SourceType type : {SourceType::kFloat32, SourceType::kBFloat16}) {
    Data a = makeData(4, n, type), b = makeData(4, n, type);
    onePass(a, type, n);
    kPasses(b, type, n);
    for (int p = 0; p < 4; ++p) {
      if (std::memcmp(a.emas[p].data(), b.emas[p].data(), n * sizeof(float)) != 0) {
        std::fprintf(stderr, "posthoc_bench: one pass differs from k passes (%s, profile %d)\n",
                     typeName(type), p);
        std::exit(1);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Our own flag, taken out before Google Benchmark sees the arguments.
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const char* prefix = "--posthoc_elements=";
    if (std::strncmp(argv[i], prefix, std::strlen(prefix)) == 0) {
      gElements = std::atoll(argv[i] + std::strlen(prefix));
      if (gElements < 1) {
        std::fprintf(stderr, "posthoc_bench: --posthoc_elements must be >= 1\n");
        return 1;
      }
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  shardema::bench::warnIfUnoptimised("posthoc_bench");
  benchmark::AddCustomContext("elements_per_profile", std::to_string(gElements));
  benchmark::AddCustomContext("threads", std::to_string(kThreads));
  checkOnePassMatches();
  registerAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
