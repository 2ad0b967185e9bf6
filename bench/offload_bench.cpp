// offload_bench: the chunked update pipeline (UpdatePipeline + the host copy
// engine) on its two paths, beside its limits measured in the same process,
// the overlap of the EMA with a synthetic training step, the staging sweep
// and the fixed cost per tensor.
//
// Data: kTensors fp32 (or bf16) host source tensors of elements/kTensors
// each and an fp32 EMA, all in a PinnedArena. Every size row takes elements
// as its argument: 5 sizes x4 apart from max/256 to max
// (--offload_elements=N, default 64Mi: 1..256 MiB of fp32 sources), to show
// where fixed costs stop mattering. One model lives at a time.
//   copy/<dtype>      engine copies of every source chunk into two staging
//                     slots, no math: the engine's raw bandwidth
//   update/<dtype>    updateSpans from the sources into the EMA, no copy, on
//                     one thread (as the pipeline's one math worker)
//   inplace/<dtype>   a += b over fp32 arrays of the model's size, one
//                     thread: the memory rate one thread gets (12 bytes per
//                     element counted), the unit of the traffic limit
//   pipeline/<dtype>  the staged path, submit + wait: the engine copies each
//                     chunk into staging, a worker does the math (what a
//                     device source takes; stageHostSources here)
//   direct/<dtype>    the direct path, submit + wait: the worker reads the
//                     host sources in place (the default for host sources)
//   GBps = source bytes / seconds / 1e9 for every row (the bytes a user's
//   model has), so the rows compare times. Pipeline rows carry copy_GBps,
//   update_GBps, limit_GBps = their minimum and frac_of_min_limit = GBps /
//   that (copy and math overlapped, each at its rate alone). Both path rows
//   carry the traffic limit, which counts every byte either path moves on
//   the memory bus: traffic_bytes_per_element (fp32 source: 20 staged, 12
//   direct; bf16: 14 / 10, see trafficPerElement) x elements at the
//   in-place rate, in GB/s of source bytes (traffic_limit_GBps) and
//   frac_of_traffic_limit. Direct rows carry frac_of_update (GBps /
//   update_GBps: the pipeline's cost over the bare kernel).
//   overlap/<dtype>   see offload_bench_overlap.cpp (staged path).
//   sweep/f32         the staged path at the largest size for chunkBytes x
//                     numSlots (1, 4, 8, 32 MiB x 2, 4 slots), with the
//                     traffic-limit columns: what kDefaultChunkBytes is
//                     chosen from.
//   small/<path>      1000 tensors of 16 elements, see offload_bench_small.cpp.
// Counters staging_bytes (what the staged path allocated: numSlots x
// chunkBytes for models of more chunks than slots, 0 on the direct path) and device_bytes (0: the
// EMA and the staging live in host memory) are reported on every row.
#include <ATen/ops/empty.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "offload_bench_model.h"

namespace offload_bench {

using namespace shardema;

int64_t gMaxElements = int64_t{64} << 20;  // 256 MiB of fp32 sources
int64_t gOverlapRounds = 10;

Model::Model(at::ScalarType dtype_, int64_t elements_)
    : dtype(dtype_), pool(1), elements(elements_) {
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
  options.stageHostSources = true;
  staged = std::make_unique<offload::UpdatePipeline>(options);
  options.stageHostSources = false;
  options.numSlots = 1;  // never used by the direct path: keep it small
  options.chunkBytes = offload::kDefaultChunkBytes;
  direct = std::make_unique<offload::UpdatePipeline>(options);
}

std::vector<offload::PipelineJob> Model::jobs() const {
  std::vector<offload::PipelineJob> out;
  for (int t = 0; t < kTensors; ++t) {
    out.push_back({emas[t], sources[t], UpdateOp::kLerp, "t" + std::to_string(t), {}});
  }
  return out;
}

void Model::ema(offload::UpdatePipeline& pipeline) {
  pipeline.submit(jobs(), {kWeight}, ++step);
  pipeline.wait();
}

std::vector<UpdateSpan> Model::spans() const {
  std::vector<UpdateSpan> out;
  for (int t = 0; t < kTensors; ++t) {
    out.push_back({emas[t].data_ptr<float>(), sources[t].data_ptr(),
                   dtype == at::kFloat ? SourceType::kFloat32 : SourceType::kBFloat16,
                   emas[t].numel(), UpdateOp::kLerp});
  }
  return out;
}

const std::vector<at::Tensor>& Model::addends() {
  if (addends_.empty()) {
    for (const at::Tensor& ema : emas) addends_.push_back(arena.allocate(ema.sizes(), at::kFloat));
    for (at::Tensor& addend : addends_) addend.zero_();
  }
  return addends_;
}

Model& model(at::ScalarType dtype, int64_t elements) {
  static std::unique_ptr<Model> current;
  if (!current || current->dtype != dtype || current->elements != elements) {
    current.reset();  // free the previous model before allocating the next
    current = std::make_unique<Model>(dtype, elements);
  }
  return *current;
}

std::map<std::pair<at::ScalarType, int64_t>, Rates>& rates() {
  static std::map<std::pair<at::ScalarType, int64_t>, Rates> all;
  return all;
}

void counters(benchmark::State& state, const Model& m, double gbps) {
  state.SetBytesProcessed(state.iterations() * m.sourceBytes);
  state.counters["GBps"] = gbps;
  state.counters["staging_bytes"] = static_cast<double>(m.staged->stats().stagingBytes);
  state.counters["device_bytes"] = 0;  // host engine and host arena: nothing on a device
}

namespace {

// Slots from the caller: allocating them per pass swamps small sizes.
void copyOnly(Model& m, const std::vector<at::Tensor>& slots, int64_t chunk) {
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
  const int64_t chunk = m.staged->options().chunkBytes;
  const std::vector<at::Tensor> slots = {m.arena.allocate({chunk}, at::kByte),
                                         m.arena.allocate({chunk}, at::kByte)};
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    copyOnly(m, slots, chunk);
    total += seconds(Clock::now() - start);
  }
  const double gbps = m.sourceBytes * state.iterations() / total / 1e9;
  rates()[{dtype, state.range(0)}].copy = gbps;
  counters(state, m, gbps);
}

void BM_Update(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  const std::vector<UpdateSpan> spans = m.spans();
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    updateSpans(spans, kWeight);  // one thread, like the pipeline's worker
    total += seconds(Clock::now() - start);
  }
  const double gbps = m.sourceBytes * state.iterations() / total / 1e9;
  rates()[{dtype, state.range(0)}].update = gbps;
  counters(state, m, gbps);
}

// a += b, the plain loop the compiler vectorises (this file is built -O3
// like the kernels).
void addInPlace(float* __restrict a, const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

void BM_InPlace(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  const std::vector<at::Tensor>& addends = m.addends();
  double total = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    for (int t = 0; t < kTensors; ++t) {
      addInPlace(m.emas[t].data_ptr<float>(), addends[t].data_ptr<float>(), m.emas[t].numel());
    }
    total += seconds(Clock::now() - start);
  }
  const int64_t bytes = m.elements / kTensors * kTensors * 12;
  const double gbps = bytes * static_cast<double>(state.iterations()) / total / 1e9;
  rates()[{dtype, state.range(0)}].inplace = gbps;
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["GBps"] = gbps;
  state.counters["bytes_per_element"] = 12;
}

// Times `pipeline` over `m` and reports the rate and the traffic limit.
// `paired`, when given, runs untimed here once per pass, before and after it
// in turn, so that neither side always meets the other's cache leftovers.
double timePipeline(benchmark::State& state, Model& m, offload::UpdatePipeline& pipeline,
                    const std::function<void()>& paired = {}) {
  double total = 0;
  bool pairedFirst = false;
  for (auto _ : state) {
    pairedFirst = !pairedFirst;
    if (paired && pairedFirst) paired();
    const auto start = Clock::now();
    m.ema(pipeline);
    total += seconds(Clock::now() - start);
    if (paired && !pairedFirst) paired();
  }
  const double gbps = m.sourceBytes * state.iterations() / total / 1e9;
  counters(state, m, gbps);
  const auto found = rates().find({m.dtype, m.elements});
  if (found == rates().end() || found->second.inplace <= 0) return gbps;  // filtered out
  const bool staged = pipeline.options().stageHostSources;
  const int64_t size = m.dtype == at::kFloat ? 4 : 2;
  const int64_t traffic = trafficPerElement(size, staged);
  // inplace counts 12 bytes per element; the limit moves `traffic` bytes
  // per element at that rate and is stated in source bytes.
  const double limit = found->second.inplace * static_cast<double>(size) / traffic;
  state.counters["inplace_GBps"] = found->second.inplace;
  state.counters["traffic_bytes_per_element"] = static_cast<double>(traffic);
  state.counters["traffic_limit_GBps"] = limit;
  state.counters["frac_of_traffic_limit"] = gbps / limit;
  state.counters["chunk_bytes"] = static_cast<double>(pipeline.options().chunkBytes);
  state.counters["slots"] = pipeline.options().numSlots;
  return gbps;
}

void BM_Pipeline(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  const double gbps = timePipeline(state, m, *m.staged);
  const Rates& r = rates()[{dtype, state.range(0)}];
  if (r.copy > 0 && r.update > 0) {
    const double limit = std::min(r.copy, r.update);
    state.counters["copy_GBps"] = r.copy;
    state.counters["update_GBps"] = r.update;
    state.counters["limit_GBps"] = limit;
    state.counters["frac_of_min_limit"] = gbps / limit;
  }
}

// The direct path, each pass paired with a pass of the update alone over the
// same model, in alternating order. On a shared VM the memory rate drifts
// by 20% between rows a second apart, more than the gap measured here, so
// frac_of_update divides two times taken under the same load. The paired
// pass runs on the pool's worker, the thread the direct path's math runs
// on: on this 2-vCPU VM the main thread's vCPU was up to 15% faster than
// the worker's in some runs, and pinned to one vCPU (taskset) both ways of
// pairing gave the same 0.96-0.98.
void BM_Direct(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  const std::vector<UpdateSpan> spans = m.spans();
  double alone = 0;
  const double gbps = timePipeline(state, m, *m.direct, [&] {
    std::promise<double> seconds;
    m.pool.post([&] {
      const auto start = Clock::now();
      updateSpans(spans, kWeight);
      seconds.set_value(offload_bench::seconds(Clock::now() - start));
    });
    alone += seconds.get_future().get();
  });
  const double pairedUpdate = m.sourceBytes * state.iterations() / alone / 1e9;
  state.counters["update_GBps"] = pairedUpdate;
  state.counters["frac_of_update"] = gbps / pairedUpdate;
  const offload::PipelineStats stats = m.direct->stats();
  state.counters["waiter_share"] = static_cast<double>(stats.waiterChunks) /
                                   static_cast<double>(std::max<int64_t>(stats.chunks, 1));
}

// The staged path with chunk_MiB x slots staging, over the model of the
// largest size (built by the rows just before).
void BM_Sweep(benchmark::State& state, at::ScalarType dtype) {
  Model& m = model(dtype, state.range(0));
  offload::UpdatePipelineOptions options = m.staged->options();
  options.chunkBytes = state.range(1) << 20;
  options.numSlots = static_cast<int>(state.range(2));
  offload::UpdatePipeline pipeline(options);
  m.ema(pipeline);  // untimed: the fresh staging's first touch (page faults)
  timePipeline(state, m, pipeline);
  state.counters["staging_bytes"] = static_cast<double>(pipeline.stats().stagingBytes);
}

// Removes our --offload_* flags from argv (Google Benchmark rejects flags
// it does not know); false after printing why when one is invalid.
bool takeOwnFlags(int& argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto valueOf = [&](const std::string& prefix) {
      return arg.rfind(prefix, 0) == 0 ? std::atoll(arg.c_str() + prefix.size()) : -1;
    };
    if (const int64_t n = valueOf("--offload_elements="); n != -1)
      gMaxElements = n;
    else if (const int64_t r = valueOf("--offload_overlap_rounds="); r != -1)
      gOverlapRounds = r;
    else
      argv[out++] = argv[i];
  }
  argc = out;
  // The smallest size (max/256) must still give every tensor an element.
  if (gMaxElements < 256 * kTensors || gOverlapRounds < 1) {
    std::fprintf(stderr, "offload_bench: need elements >= %d, rounds >= 1\n", 256 * kTensors);
    return false;
  }
  return true;
}

void registerRows() {
  using Fn = void (*)(benchmark::State&, at::ScalarType);
  // Size by size, the rows of one size together: the pipeline rows read
  // the rates just measured, and model() keeps one model.
  for (auto [dtype, name] : {std::pair{at::kFloat, "f32"}, std::pair{at::kBFloat16, "bf16"}}) {
    const std::string n = name;
    for (int64_t divisor = 256; divisor >= 1; divisor /= 4) {
      const int64_t elements = gMaxElements / divisor / kTensors * kTensors;
      for (auto [row, fn] : {std::pair<const char*, Fn>{"copy/", BM_Copy},
                             {"update/", BM_Update},
                             {"inplace/", BM_InPlace},
                             {"pipeline/", BM_Pipeline},
                             {"direct/", BM_Direct},
                             {"averager/", BM_Averager},
                             {"overlap/", BM_Overlap}}) {
        auto* b = benchmark::RegisterBenchmark((row + n).c_str(), fn, dtype)->Arg(elements);
        b->ArgName("elements")->Unit(benchmark::kMillisecond);
        // The averager rows time their update alone (their paired kernel
        // passes run in the same loop).
        if (fn == BM_Averager) {
          b->UseManualTime();
        } else {
          b->UseRealTime();
        }
        if (fn == BM_Overlap) b->Iterations(gOverlapRounds);
      }
      if (divisor != 1 || dtype != at::kFloat) continue;
      // The staging sweep reuses the f32 model of the largest size.
      auto* b = benchmark::RegisterBenchmark(("sweep/" + n).c_str(), BM_Sweep, dtype);
      for (int64_t mib : {1, 4, 8, 32}) {
        for (int64_t slots : {2, 4}) b->Args({elements, mib, slots});
      }
      b->ArgNames({"elements", "chunk_MiB", "slots"})->UseRealTime()->Unit(benchmark::kMillisecond);
    }
  }
  for (int path : {0, 1}) {
    auto* b = benchmark::RegisterBenchmark(path == 0 ? "small/direct" : "small/staged",
                                           BM_SmallTensors, path);
    b->UseRealTime()->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark("small/averager", BM_SmallTensors, 2)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace
}  // namespace offload_bench

int main(int argc, char** argv) {
  if (!offload_bench::takeOwnFlags(argc, argv)) return 1;
#if !defined(__OPTIMIZE__)
  std::fprintf(stderr,
               "offload_bench: built without optimisation (%s); numbers are not "
               "representative\n",
               SHARDEMA_BUILD_TYPE);
#endif
  offload_bench::registerRows();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
