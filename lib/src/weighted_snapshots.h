#pragma once
// The arithmetic both post-hoc synthesis front ends share (not installed):
// the used snapshots opened once with their weights, per-tensor checks and
// the float64 weighted sum, streamed to a sink in bounded rounds.
// Both front ends of synthesis.h use it: posthoc_folder_synthesis.cpp sinks
// into a file, posthoc_snapshot_synthesis.cpp into memory.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/posthoc_synthesis.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/shard/shard_spec.h"
#include "shardema/synthesis.h"

namespace shardema {
namespace detail {

/// The snapshots of one rank (or of a whole full-copy folder) that the
/// solve uses, opened once, with their weights.
struct WeightedReaders {
  std::vector<std::unique_ptr<TensorFileReader>> readers;
  std::vector<double> weights;
  /// Index of the newest snapshot used: integer/bool copies come from it.
  size_t newest = 0;
};

/// Opens entries[i] for every solve.used[i].
WeightedReaders openUsed(const std::vector<SnapshotEntry>& entries, const SynthesisWeights& solve);

/// Checks that every used snapshot holds `name` with `numel` elements of
/// one dtype (float32 for floating tensors, as writeSnapshot stores them)
/// and returns that dtype; c10::ValueError naming the file otherwise.
at::ScalarType checkTensor(const WeightedReaders& used, const std::string& name, int64_t numel);

/// The solve for the entries' (step, gamma) under `options`.
SynthesisWeights solveFor(const std::vector<SnapshotEntry>& entries,
                          const SnapshotSynthesisOptions& options);

/// dtype float32/bfloat16/float16 and bufferBytes >= 64; c10::ValueError.
void checkSynthesisOptions(const SnapshotSynthesisOptions& options);

/// Called with consecutive 1-D pieces of one tensor, in order.
using PieceConsumer = std::function<void(const at::Tensor& piece)>;

/// Elements [begin, begin + count) of `name` as synthesized from `used`, in
/// rounds of at most roundElements: the weighted float64 sum converted to
/// outType for floating tensors, the newest snapshot's values for copies.
/// `scratch` holds the accumulators between calls (no reallocation).
void synthesizeRange(const WeightedReaders& used, const std::string& name, at::ScalarType type,
                     int64_t begin, int64_t count, int64_t roundElements, c10::ScalarType outType,
                     std::vector<double>& scratch, const PieceConsumer& consume);

/// The shape of a tensor whose spec describes it with dim `splitDim` moved
/// first (tensor parallelism's Shard(splitDim), SnapshotInfo::splitDims):
/// the spec's shape with dim 0 moved back there. The spec's own for 0.
std::vector<int64_t> splitTensorShape(const shard::ShardSpec& spec, int64_t splitDim);

/// The metadata of a synthesized deployable file: shardema.kind =
/// deployable_weights, shardema.sigma_rel, shardema.gamma (17 digits),
/// shardema.step, shardema.synthesis = raw|normalized.
std::map<std::string, std::string> synthesizedMetadata(const SynthesisWeights& solve,
                                                       bool normalize);

}  // namespace detail
}  // namespace shardema
