// Over the 400-line guideline on purpose: every row shares one arena, the
// rate table the ratio columns read and the paired limit, which Google
// Benchmark registration ties to this file; the limit loops are apart in
// update_bench_limit.h.
//
// update_bench: GB/s of the fused EMA update (the checked spans of
// shardema::spansOf run over a pool by offload::updateOnPool) beside the
// bandwidth limit and the ATen peers, measured in one process.
//
// Data: 256M elements (fp32 EMA 1 GiB, fp32 source 1 GiB, one 2-byte source
// 0.5 GiB read as bf16 or fp16), allocated once on 2 MiB-aligned, huge-page
// advised memory and shared by every row; --update_elements=N changes the
// 256M (scripts/bench.sh --quick uses a smaller arena). Layouts: "one" = one tensor of
// 256M; "small" = the same memory as 1000 contiguous tensors of 134K-403K
// elements (0.5-1.6 MiB of fp32 each), so both layouts move the same bytes.
// Peak memory: 2.5 GiB plus ATen's temporaries (1 GiB for the bf16 peers).
//
// Bytes counted per element, for every row alike: 12 for an fp32 source
// (read ema, read source, write ema), 10 for bf16/fp16. The ATen peers move
// more (a float copy of bf16, or ema twice for mul_ then add_): counting
// the same work makes GB/s compare times.
//   GBps            counted bytes / wall seconds / 1e9
//   frac_of_limit   GBps / GBps of limit passes interleaved with ours
//                   (see benchOurs); frac_vs_limit_row: / the limit row
//   x_foreach       GBps / aten_foreach GBps, same dtype and layout
//   x_lerp_loop     GBps / aten_lerp_loop GBps, same dtype and layout
// limit: in-place a[i] += b[i] (a -= b on odd passes, so values stay put)
// over the fp32 ema and source arrays: 12 B/elem in the access pattern of
// the update (two streams read, one written back in place), our own
// explicit AVX2 loop split over the same offload::WorkerPool. The paired
// limit of a bf16/fp16 row reads a 2-byte stream instead (10 B/elem, the
// row's own pattern); frac_vs_limit_row always divides by the fp32 row. It is registered first so
// it is measured before the rows that divide by it. Threads (the benchmark arg) = pool workers +
// the calling thread; ATen rows run with at::set_num_threads(threads) for a fair comparison. Kernel
// variants: kernel/<variant>/<dtype>/one/threads:T runs one KernelVariant (baseline, avx2, avx512:
// those this CPU has) alone over the arena, split over the pool like updateOnPool, each pass paired
// with a limit pass as "ours" is; active_variant in the context says which one the update path
// uses. Scaling: ours/<dtype>/one at threads 1, 2, 4, ... up to this machine's hardware threads
// (and that count itself): the host math's rate per core count, the EMA's cost on a GPU node where
// it runs beside training. Size sweep: ours_size/<dtype>/one/threads:2/elements:N runs ours on a
// prefix of N elements (arena/256 .. the arena, x4 apart: 1Mi..256Mi by
// default), each with its paired limit pass over the same prefix, to show
// where the update leaves the caches and meets the memory limit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "build_type_warning.h"
#include "shardema/core/kernel_variant.h"
#include "shardema/core/tensor_update.h"
#include "shardema/offload/parallel_update.h"
#include "shardema/offload/worker_pool.h"
#include "update_bench_limit.h"

namespace {

int64_t kElements = int64_t{256} << 20;  // set once in main, before the arena
constexpr int kSmallTensors = 1000;
constexpr double kWeight = 0.001;        // 1 - decay at decay 0.999
constexpr int64_t kPiecesPerThread = 4;  // as offload::updateOnPool splits

enum class Layout { kOne, kSmall };
const char* layoutName(Layout l) { return l == Layout::kOne ? "one" : "small"; }
const char* dtypeName(at::ScalarType t) {
  return t == at::kFloat ? "f32" : t == at::kBFloat16 ? "bf16" : "f16";
}
double bytesPerElement(at::ScalarType t) { return t == at::kFloat ? 12.0 : 10.0; }

at::Tensor hugePageTensor(int64_t n, at::ScalarType dtype) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes =
      (static_cast<size_t>(n) * c10::elementSize(dtype) + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, bytes);
  TORCH_CHECK(p != nullptr, "update_bench: cannot allocate ", bytes, " bytes");
  madvise(p, bytes, MADV_HUGEPAGE);  // advice only; runs without it too
  return at::from_blob(
      p, {n}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(dtype));
}

struct Arena {
  at::Tensor ema, f32, half16;   // half16: bits that are normal as bf16 and as fp16
  std::vector<int64_t> offsets;  // kSmallTensors + 1 boundaries of the "small" layout
};

Arena makeArena() {
  Arena a{hugePageTensor(kElements, at::kFloat),
          hugePageTensor(kElements, at::kFloat),
          hugePageTensor(kElements, at::kBFloat16),
          {}};
  float* ema = a.ema.data_ptr<float>();
  float* f32 = a.f32.data_ptr<float>();
  auto* u16 = static_cast<uint16_t*>(a.half16.data_ptr());
  for (int64_t i = 0; i < kElements; ++i) {
    ema[i] = 0.5f + static_cast<float>(i % 1024) / 4096.0f;
    f32[i] = static_cast<float>(i % 777) / 777.0f;
    // 0x3800..0x3ffe: fp16 0.5..2, bf16 2^-15..2: never subnormal, which
    // would slow every row down through microcode assists.
    u16[i] = static_cast<uint16_t>(0x3800 + i % 0x07ff);
  }
  const int64_t base = kElements / kSmallTensors;
  a.offsets.push_back(0);
  for (int i = 0; i < kSmallTensors - 1; ++i) {
    a.offsets.push_back(a.offsets.back() + base / 2 + base * ((i * 389) % 1000) / 1000);
  }
  a.offsets.push_back(kElements);
  return a;
}

Arena& arena() {
  static Arena a = makeArena();
  return a;
}

at::Tensor sourceOf(at::ScalarType dtype) {
  Arena& a = arena();
  return dtype == at::kFloat ? a.f32 : dtype == at::kBFloat16 ? a.half16 : a.half16.view(at::kHalf);
}

std::vector<at::Tensor> parts(const at::Tensor& t, Layout layout) {
  if (layout == Layout::kOne) {
    return {t};
  }
  const std::vector<int64_t>& o = arena().offsets;
  std::vector<at::Tensor> out;
  for (size_t i = 0; i + 1 < o.size(); ++i) {
    out.push_back(t.narrow(0, o[i], o[i + 1] - o[i]));
  }
  return out;
}

shardema::offload::WorkerPool& poolFor(int threads) {
  static std::map<int, std::unique_ptr<shardema::offload::WorkerPool>> pools;
  auto& p = pools[threads];
  if (!p) {
    p = std::make_unique<shardema::offload::WorkerPool>(threads - 1);
  }
  return *p;
}

// GB/s of earlier rows, keyed "<row>/<dtype>/<layout>/<threads>".
std::map<std::string, double>& rates() {
  static std::map<std::string, double> r;
  return r;
}

std::string key(const std::string& row, const std::string& dtype, Layout l, int threads) {
  return row + "/" + dtype + "/" + layoutName(l) + "/" + std::to_string(threads);
}

// Times the state loop on the wall clock, sets bytes processed and GBps, and
// records the rate under `k`. Returns GB/s.
template <typename F>
double timed(benchmark::State& state, double bytesPerIteration, const std::string& k, F body) {
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    body();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double bytes = bytesPerIteration * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  const double gbps = bytes / seconds / 1e9;
  state.counters["GBps"] = gbps;
  rates()[k] = gbps;
  return gbps;
}

// One pass of the limit kernel over the whole arena, split like updateOnPool
// splits; alternates += and -= so repeated passes keep the values in range.
// `n` elements from the start of the arena (the size sweep), all by default;
// `dtype` a 16-bit type: the 2-byte source stream (10 B per element).
void limitPass(shardema::offload::WorkerPool& pool, int threads, int64_t n = kElements,
               at::ScalarType dtype = at::kFloat) {
  static float sign = 1.0f;
  float* a = arena().ema.data_ptr<float>();
  const float* b = arena().f32.data_ptr<float>();
  const auto* b16 = static_cast<const uint16_t*>(arena().half16.data_ptr());
  const int64_t pieces = threads * kPiecesPerThread;
  pool.parallelFor(pieces, [&](int64_t p) {
    const int64_t begin = n / pieces * p, end = p + 1 == pieces ? n : begin + n / pieces;
    if (dtype == at::kFloat) {
      shardema::bench::addInPlace(a + begin, b + begin, end - begin, sign);
    } else {
      shardema::bench::addInPlace16(a + begin, b16 + begin, end - begin, sign);
    }
  });
  sign = -sign;
}

template <typename F>
double secondsOf(F f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void benchLimit(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  shardema::offload::WorkerPool& pool = poolFor(threads);
  timed(state, 12.0 * kElements, key("limit", "f32", Layout::kOne, threads),
        [&] { limitPass(pool, threads); });
}

// ATen peers run on ATen's own pool sized like ours; the counter records
// what ATen really took. Returns the EMA and source tensors of the layout.
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> atenPeerInputs(benchmark::State& state,
                                                                           at::ScalarType dtype,
                                                                           Layout layout,
                                                                           int threads) {
  at::set_num_threads(threads);
  state.counters["aten_threads"] = at::get_num_threads();
  return {parts(arena().ema, layout), parts(sourceOf(dtype), layout)};
}

void benchAtenLerpLoop(benchmark::State& state, at::ScalarType dtype, Layout layout) {
  const int threads = static_cast<int>(state.range(0));
  const auto [emas, srcs] = atenPeerInputs(state, dtype, layout, threads);
  timed(state, bytesPerElement(dtype) * kElements,
        key("lerp_loop", dtypeName(dtype), layout, threads), [&] {
          for (size_t i = 0; i < emas.size(); ++i) {
            at::Tensor ema = emas[i];
            ema.lerp_(dtype == at::kFloat ? srcs[i] : srcs[i].to(at::kFloat), kWeight);
          }
        });
}

void benchAtenForeach(benchmark::State& state, at::ScalarType dtype, Layout layout) {
  const int threads = static_cast<int>(state.range(0));
  const auto [emas, srcs] = atenPeerInputs(state, dtype, layout, threads);
  timed(state, bytesPerElement(dtype) * kElements,
        key("foreach", dtypeName(dtype), layout, threads), [&] {
          std::vector<at::Tensor> floats;
          if (dtype != at::kFloat) {
            for (const at::Tensor& s : srcs) {
              floats.push_back(s.to(at::kFloat));
            }
          }
          at::_foreach_mul_(emas, 1.0 - kWeight);
          at::_foreach_add_(emas, dtype == at::kFloat ? srcs : floats, kWeight);
        });
}

// Times `body` on the wall clock, each iteration after one limit pass of
// the same elements and dtype (not counted), and sets GBps, limit_GBps and
// frac_of_limit: on a shared 2-core box a neighbour's burst can halve any
// row, and the paired limit saw the same load. Returns GB/s.
template <typename Body>
double pairedWithLimit(benchmark::State& state, shardema::offload::WorkerPool& pool, int threads,
                       int64_t elements, at::ScalarType dtype, const Body& body) {
  double ours = 0.0, limit = 0.0;
  for (auto _ : state) {
    limit += secondsOf([&] { limitPass(pool, threads, elements, dtype); });
    const double s = secondsOf(body);
    ours += s;
    state.SetIterationTime(s);
  }
  const double bytes = bytesPerElement(dtype) * static_cast<double>(state.iterations()) *
                       static_cast<double>(elements);
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  const double gbps = bytes / ours / 1e9;
  const double limitGbps = bytes / limit / 1e9;
  state.counters["GBps"] = gbps;
  state.counters["limit_GBps"] = limitGbps;
  state.counters["frac_of_limit"] = gbps / limitGbps;
  return gbps;
}

void setRatio(benchmark::State& state, const char* name, double gbps, const std::string& k) {
  auto it = rates().find(k);
  if (it != rates().end()) {
    state.counters[name] = gbps / it->second;
  }
}

// On a shared 2-core box a neighbour's burst can halve any row, so besides
// the limit row measured first, every iteration here also runs one limit
// pass right before our pass (not counted in this row's time) and
// frac_of_limit divides by that paired limit: both saw the same load.
void benchOurs(benchmark::State& state, at::ScalarType dtype, Layout layout) {
  const int threads = static_cast<int>(state.range(0));
  shardema::offload::WorkerPool& pool = poolFor(threads);
  const std::vector<at::Tensor> emas = parts(arena().ema, layout);
  const std::vector<at::Tensor> srcs = parts(sourceOf(dtype), layout);
  std::vector<shardema::TensorUpdate> updates;
  for (size_t i = 0; i < emas.size(); ++i) {
    updates.push_back({emas[i], srcs[i], shardema::UpdateOp::kLerp, "t" + std::to_string(i)});
  }
  const double gbps = pairedWithLimit(state, pool, threads, kElements, dtype, [&] {
    shardema::offload::updateOnPool(pool, shardema::spansOf(updates, kWeight), kWeight);
  });
  const std::string d = dtypeName(dtype);
  rates()[key("ours", d, layout, threads)] = gbps;
  setRatio(state, "frac_vs_limit_row", gbps, key("limit", "f32", Layout::kOne, threads));
  setRatio(state, "x_foreach", gbps, key("foreach", d, layout, threads));
  setRatio(state, "x_lerp_loop", gbps, key("lerp_loop", d, layout, threads));
}

// One variant's lerp alone over the arena as one tensor, cut into the
// pieces updateOnPool would make, paired with a limit pass like benchOurs.
void benchVariant(benchmark::State& state, shardema::KernelVariant variant, at::ScalarType dtype) {
  const int threads = static_cast<int>(state.range(0));
  shardema::offload::WorkerPool& pool = poolFor(threads);
  float* ema = arena().ema.data_ptr<float>();
  const auto* src = static_cast<const char*>(sourceOf(dtype).data_ptr());
  const shardema::SourceType type = dtype == at::kFloat      ? shardema::SourceType::kFloat32
                                    : dtype == at::kBFloat16 ? shardema::SourceType::kBFloat16
                                                             : shardema::SourceType::kFloat16;
  const int64_t size = shardema::sourceTypeSize(type);
  const int64_t pieces = threads * kPiecesPerThread;
  pairedWithLimit(state, pool, threads, kElements, dtype, [&] {
    pool.parallelFor(pieces, [&](int64_t p) {
      const int64_t begin = kElements / pieces * p;
      const int64_t end = p + 1 == pieces ? kElements : begin + kElements / pieces;
      shardema::lerpRangeWith(variant, ema + begin, src + begin * size, type, end - begin,
                              static_cast<float>(kWeight));
    });
  });
}

// The size sweep: ours on the first `elements` of the arena as one tensor,
// paired with a limit pass over the same prefix, as benchOurs pairs them.
void benchOursSize(benchmark::State& state, at::ScalarType dtype) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t elements = state.range(1);
  shardema::offload::WorkerPool& pool = poolFor(threads);
  const std::vector<shardema::TensorUpdate> updates = {{arena().ema.narrow(0, 0, elements),
                                                        sourceOf(dtype).narrow(0, 0, elements),
                                                        shardema::UpdateOp::kLerp, "prefix"}};
  state.counters["elements"] = static_cast<double>(elements);
  pairedWithLimit(state, pool, threads, elements, dtype,
                  [&] {
                    shardema::offload::updateOnPool(pool, shardema::spansOf(updates, kWeight),
                                                    kWeight);
                  });
}

void registerAll() {
  const std::vector<int> threadCounts = {2, 1};
  // Wall time: work runs on pool threads too. Ours times itself (manual) so
  // its interleaved limit passes stay out of its row.
  auto common = [&](benchmark::internal::Benchmark* b, bool manualTime = false) {
    b->ArgName("threads")->Unit(benchmark::kMillisecond);
    if (manualTime) {
      b->UseManualTime();
    } else {
      b->UseRealTime();
    }
    for (int t : threadCounts) {
      b->Arg(t);
    }
  };
  common(benchmark::RegisterBenchmark("limit_add_inplace/f32/one", benchLimit));
  for (Layout layout : {Layout::kOne, Layout::kSmall}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const std::string suffix = std::string("/") + dtypeName(dtype) + "/" + layoutName(layout);
      if (dtype != at::kHalf) {  // the peers' fp16 numbers would mirror bf16
        common(benchmark::RegisterBenchmark(("aten_lerp_loop" + suffix).c_str(), benchAtenLerpLoop,
                                            dtype, layout));
        common(benchmark::RegisterBenchmark(("aten_foreach" + suffix).c_str(), benchAtenForeach,
                                            dtype, layout));
      }
      common(benchmark::RegisterBenchmark(("ours" + suffix).c_str(), benchOurs, dtype, layout),
             true);
    }
  }
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (shardema::KernelVariant variant : shardema::availableKernelVariants()) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const std::string name = std::string("kernel/") + shardema::kernelVariantName(variant) + "/" +
                               dtypeName(dtype) + "/one";
      auto* b = benchmark::RegisterBenchmark(name.c_str(), benchVariant, variant, dtype);
      b->ArgName("threads")->Unit(benchmark::kMillisecond)->UseManualTime();
      b->Arg(1);
      if (hardware > 1) b->Arg(hardware);
    }
  }
  // Thread scaling of the host math (1 and 2 threads are in the rows above).
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    std::vector<int> counts;
    for (int t = 4; t < hardware; t *= 2) counts.push_back(t);
    if (hardware > 2) counts.push_back(hardware);
    if (counts.empty()) continue;
    auto* b = benchmark::RegisterBenchmark(
        (std::string("ours_scaling/") + dtypeName(dtype) + "/one").c_str(), benchOurs, dtype,
        Layout::kOne);
    b->ArgName("threads")->Unit(benchmark::kMillisecond)->UseManualTime();
    for (int t : counts) b->Arg(t);
  }
  // fp16 would repeat bf16's bytes and shape; 2 threads as on the target VM.
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto* b = benchmark::RegisterBenchmark(
        (std::string("ours_size/") + dtypeName(dtype) + "/one").c_str(), benchOursSize, dtype);
    b->ArgNames({"threads", "elements"})->Unit(benchmark::kMillisecond)->UseManualTime();
    for (int64_t divisor = 256; divisor >= 1; divisor /= 4) {
      b->Args({2, std::max<int64_t>(1, kElements / divisor)});
    }
  }
}

// Correctness in the same run: ours against ATen's lerp_ (which for w < 0.5
// evaluates the same ema + w*(x - ema)) on a prefix of the real data.
void checkAgainstAten() {
  const int64_t n = std::min<int64_t>(1 << 20, kElements);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor ours = arena().ema.narrow(0, 0, n).clone();
    const at::Tensor src = sourceOf(dtype).narrow(0, 0, n);
    const at::Tensor theirs = ours.clone().lerp_(src.to(at::kFloat), kWeight);
    shardema::lerpInto(ours, src, kWeight);
    TORCH_CHECK(at::allclose(ours, theirs, 1e-6, 0.0), "update_bench: ", dtypeName(dtype),
                " result differs from ATen lerp_");
  }
}

}  // namespace

// Removes --update_elements=N from argv (Google Benchmark rejects flags it
// does not know) and sets kElements from it.
bool takeElementsFlag(int& argc, char** argv) {
  const char* prefix = "--update_elements=";
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix, std::strlen(prefix)) == 0) {
      kElements = std::atoll(argv[i] + std::strlen(prefix));
      if (kElements < kSmallTensors) {
        std::fprintf(stderr, "update_bench: --update_elements must be >= %d\n", kSmallTensors);
        return false;
      }
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  return true;
}

int main(int argc, char** argv) {
  if (!takeElementsFlag(argc, argv)) {
    return 1;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  shardema::bench::warnIfUnoptimised("update_bench");
  benchmark::AddCustomContext("elements", std::to_string(kElements));
  benchmark::AddCustomContext("small_layout_tensors", std::to_string(kSmallTensors));
  benchmark::AddCustomContext("active_variant",
                              shardema::kernelVariantName(shardema::activeKernelVariant()));
  benchmark::AddCustomContext("hardware_threads",
                              std::to_string(std::thread::hardware_concurrency()));
  checkAgainstAten();
  registerAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
