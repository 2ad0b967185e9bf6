#pragma once
// A toy model run two ways: one Averager over the full tensors (the
// single-process reference) and W ShardedAveragers, one per rank, each over
// its own copy of the model (as every rank holds its own memory), all in one
// thread. Values are a pure function of (tensor, element, step), so any
// mismatch points at itself.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "shardema/averager.h"
#include "shardema/sharded_averager.h"
#include "support/same_bytes.h"

namespace shardema::testing {

struct ModelTensor {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  TrackRole role = TrackRole::kAverage;
};

/// Uneven sizes of docs/spec/shard_layouts.md: numel 0, 1, primes, d0 < W,
/// d0 = W*k +- 1, 0-dim, and an integer buffer that is copied.
inline std::vector<ModelTensor> unevenModel(at::ScalarType floating, bool withIntegerBuffer) {
  std::vector<ModelTensor> model = {
      {"empty", {0}, floating},
      {"one", {1}, floating},
      {"prime", {13}, floating},
      {"rows", {5, 3}, floating},
      {"few_rows", {2, 7}, floating},
      {"zero_inner", {3, 0}, floating},
      {"scalar", {}, floating},
      {"big", {9, 17}, floating},
      {"copied", {7, 2}, floating, TrackRole::kCopy},
      {"trainable", {11}, floating, TrackRole::kAverageIfTrainable},
  };
  if (withIntegerBuffer) model.push_back({"steps_seen", {}, at::kLong, TrackRole::kCopyOnce});
  return model;
}

/// The value of element e of tensor t at step s (s = 0: initial weights).
inline at::Tensor modelValues(const ModelTensor& tensor, int64_t index, int64_t step) {
  const int64_t numel = at::empty(tensor.shape).numel();
  at::Tensor values = at::arange(numel, at::kDouble);
  values = at::sin(values * 0.37 + 1.3 * step + 0.71 * index) * (1.0 + 0.1 * index);
  if (!at::isFloatingType(tensor.dtype)) values = at::floor(values * 100.0 + step);
  return values.to(tensor.dtype).reshape(tensor.shape);
}

inline std::vector<at::Tensor> makeModel(const std::vector<ModelTensor>& model, int64_t step) {
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < model.size(); ++i) {
    tensors.push_back(modelValues(model[i], static_cast<int64_t>(i), step).contiguous());
  }
  return tensors;
}

inline void setModel(const std::vector<ModelTensor>& model, std::vector<at::Tensor>& tensors,
                     int64_t step) {
  for (size_t i = 0; i < model.size(); ++i) {
    tensors[i].copy_(modelValues(model[i], static_cast<int64_t>(i), step));
  }
}

inline std::vector<TrackedTensor> trackedModel(const std::vector<ModelTensor>& model,
                                               const std::vector<at::Tensor>& tensors) {
  std::vector<TrackedTensor> tracked;
  for (size_t i = 0; i < model.size(); ++i) {
    tracked.push_back({model[i].name, tensors[i], model[i].role});
  }
  return tracked;
}

/// kPinnedHost with small staging slots, so every tensor crosses chunk
/// boundaries that differ between the full and the per-rank runs; or
/// kDevice (CPU sources: a synchronous host EMA), which the checkpoint tests
/// use so they test files, not the pipeline.
inline AveragerOptions smallChunkOptions(EmaStorage storage = EmaStorage::kDevice) {
  AveragerOptions options;
  options.storage = storage;
  options.offload.chunkBytes = 64;
  return options;
}

/// One rank's memory: its own copy of the model and its ShardedAverager.
struct RankModel {
  std::vector<at::Tensor> tensors;  // full tensors (per-tensor kinds) or the flat shard
  std::unique_ptr<ShardedAverager> averager;
};

/// W ranks over per-tensor layouts (kFsdp2, kReplicated, kRankZero).
inline std::vector<RankModel> makeRanks(const std::vector<ModelTensor>& model,
                                        shard::LayoutKind kind, int64_t worldSize,
                                        const AveragerOptions& options = smallChunkOptions()) {
  std::vector<RankModel> ranks(static_cast<size_t>(worldSize));
  for (int64_t r = 0; r < worldSize; ++r) {
    RankModel& rank = ranks[static_cast<size_t>(r)];
    rank.tensors = makeModel(model, 0);
    rank.averager = std::make_unique<ShardedAverager>(
        r, worldSize, shardsFromFullTensors(trackedModel(model, rank.tensors), kind, r, worldSize),
        options);
  }
  return ranks;
}

/// The EMA pieces of every rank, concatenated in rank order per tensor:
/// what a gather would produce (1-D per tensor).
inline std::vector<at::Tensor> unionOfRanks(const std::vector<const ShardedAverager*>& ranks) {
  std::vector<std::vector<at::Tensor>> pieces;
  for (const ShardedAverager* rank : ranks) pieces.push_back(rank->localEma());
  std::vector<at::Tensor> full;
  for (size_t i = 0; i < pieces.front().size(); ++i) {
    std::vector<at::Tensor> parts;
    for (const auto& rankPieces : pieces) parts.push_back(rankPieces[i]);
    full.push_back(at::cat(parts));
  }
  return full;
}

inline std::vector<const ShardedAverager*> averagersOf(const std::vector<RankModel>& ranks) {
  std::vector<const ShardedAverager*> averagers;
  for (const RankModel& rank : ranks) averagers.push_back(rank.averager.get());
  return averagers;
}

/// Bitwise equality of two tensors (dtype and numel too).
inline ::testing::AssertionResult sameTensor(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) {
    return ::testing::AssertionFailure() << "dtype/numel " << a.scalar_type() << "/" << a.numel()
                                         << " vs " << b.scalar_type() << "/" << b.numel();
  }
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  if (!sameBytes(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size())) {
    return ::testing::AssertionFailure() << "values differ";
  }
  return ::testing::AssertionSuccess();
}

/// Each of `pieces` (layout order, 1-D) equals the reference EMA bit for bit.
inline void expectEqualsReference(const Averager& reference, const shard::ShardLayout& layout,
                                  const std::vector<at::Tensor>& full, const std::string& what) {
  ASSERT_EQ(full.size(), layout.specs.size()) << what;
  for (size_t i = 0; i < full.size(); ++i) {
    const std::string& name = layout.specs[i].name;
    EXPECT_TRUE(sameTensor(full[i], reference.ema(name).reshape({-1})))
        << what << ", tensor " << name;
  }
}

/// The reference Averager and W ranks of one per-tensor-layout job, stepped
/// together over the same values.
struct PerTensorJob {
  PerTensorJob(std::vector<ModelTensor> modelIn, shard::LayoutKind kind, int64_t worldSize,
               const AveragerOptions& options = smallChunkOptions())
      : model(std::move(modelIn)),
        full(makeModel(model, 0)),
        reference(trackedModel(model, full), options),
        ranks(makeRanks(model, kind, worldSize, options)) {}

  void run(int64_t firstStep, int64_t lastStep) {
    for (int64_t step = firstStep; step <= lastStep; ++step) {
      setModel(model, full, step);
      for (auto& rank : ranks) setModel(model, rank.tensors, step);
      reference.update(step);
      for (auto& rank : ranks) rank.averager->update(step);
      reference.fence();
      for (auto& rank : ranks) rank.averager->fence();
    }
    reference.wait();
    for (auto& rank : ranks) rank.averager->wait();
  }
  std::vector<const ShardedAverager*> averagers() const { return averagersOf(ranks); }

  std::vector<ModelTensor> model;
  std::vector<at::Tensor> full;
  Averager reference;
  std::vector<RankModel> ranks;
};

}  // namespace shardema::testing
