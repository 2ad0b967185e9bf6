#pragma once
// What the offload_bench rows share (offload_bench*.cpp): the model they
// update, built once per (dtype, size), and the rates the earlier rows of a
// size measured, which the later ones report beside their own.
#include <ATen/core/Tensor.h>
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/update_kernels.h"
#include "shardema/offload/copy_engine.h"
#include "shardema/offload/pinned_arena.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"

namespace offload_bench {

using Clock = std::chrono::steady_clock;

constexpr int kTensors = 16;
constexpr float kWeight = 0.001f;

inline double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// kTensors sources of one dtype, their fp32 EMAs, the host engine, one math
// worker and two pipelines over them: the staged one (host sources copied
// into staging as device sources would be) and the direct one (read in
// place, the default for host sources).
struct Model {
  Model(at::ScalarType dtype, int64_t elements);
  std::vector<shardema::offload::PipelineJob> jobs() const;
  // One update through `pipeline`, submit to wait.
  void ema(shardema::offload::UpdatePipeline& pipeline);
  // The update-alone row's spans: every source into its EMA, lerp.
  std::vector<shardema::UpdateSpan> spans() const;
  // A fp32 addend per EMA tensor for the in-place row, made on first use.
  const std::vector<at::Tensor>& addends();

  at::ScalarType dtype;
  shardema::offload::PinnedArena arena;
  // One worker for the math: with the training step on the caller and the
  // engine's copy thread, that is what a 2-core machine can give.
  shardema::offload::WorkerPool pool;
  std::unique_ptr<shardema::offload::CopyEngine> engine;
  std::unique_ptr<shardema::offload::UpdatePipeline> staged, direct;
  std::vector<at::Tensor> sources, emas;
  int64_t elements = 0, sourceBytes = 0, step = 0;

 private:
  std::vector<at::Tensor> addends_;
};

// The model of the running row. Rows are registered size by size, so this
// rebuilds once per (dtype, size) and only one model's memory is held.
Model& model(at::ScalarType dtype, int64_t elements);

// Rates measured by the rows of one (dtype, elements), in GB/s of source
// bytes, for the rows after them. inplace: GB/s of a += b over fp32 arrays
// counting 12 bytes per element (the bus rate one thread gets).
struct Rates {
  double copy = 0, update = 0, inplace = 0;
};
std::map<std::pair<at::ScalarType, int64_t>, Rates>& rates();

// Bytes one element of a source of `sourceBytes` bytes moves through
// memory: the math reads the source and the EMA and writes the EMA
// (sourceBytes + 8); the staged path's copy reads and writes the source's
// bytes once more (+ 2 x sourceBytes).
inline int64_t trafficPerElement(int64_t sourceBytes, bool staged) {
  return sourceBytes + 8 + (staged ? 2 * sourceBytes : 0);
}

// GBps, staging_bytes and device_bytes on a row over `m`.
void counters(benchmark::State& state, const Model& m, double gbps);

// The overlap row (offload_bench_overlap.cpp) and the per-tensor overhead
// rows (offload_bench_small.cpp).
void BM_Overlap(benchmark::State& state, at::ScalarType dtype);
void BM_Averager(benchmark::State& state, at::ScalarType dtype);
void BM_SmallTensors(benchmark::State& state, int path);
extern int64_t gOverlapRounds;

}  // namespace offload_bench
