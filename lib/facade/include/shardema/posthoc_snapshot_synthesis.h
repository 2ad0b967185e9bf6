#pragma once
// Post-hoc synthesis into memory: sum_i w_i snapshot_i over a list of
// snapshot files (one rank's shards, or a full-copy folder), as tensors
// rather than a file. The PostHocCallback swaps the result in for
// validation and gathers the per-rank results into deployable weights; the
// demo sweeps sigma_rel with it. posthoc_folder_synthesis.h writes a file
// instead and shares the arithmetic (float64 accumulation, copies from the
// newest snapshot used).
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardema/posthoc_folder_synthesis.h"
#include "shardema/detail/posthoc_snapshot.h"
#include "shardema/detail/posthoc_synthesis.h"

namespace shardema {

struct SynthesizedTensors {
  /// The solve, one weight per input entry (unused ones have weight 0).
  SynthesisWeights weights;
  /// In the newest used snapshot's order, under its names and shapes.
  /// Floating tensors: the weighted sum accumulated in float64, converted
  /// to options.outputDtype; integer/bool tensors: the newest used snapshot's.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
};

/// Solves the weights of options.sigmaRel at options.step (0 = the newest
/// entry; entries after it are left out) for `entries` (e.g.
/// scanSnapshotFolder(dir).snapshots, or scanRankSnapshots(dir, r)) and
/// returns the synthesized tensors. options.bufferBytes bounds the float64
/// accumulator per round; outPath-only fields are ignored. c10::ValueError
/// as solveSynthesisWeights and synthesizeSnapshotFolder (tensors that
/// differ between the snapshots, naming the file). Blocks.
SynthesizedTensors synthesizeSnapshots(const std::vector<SnapshotEntry>& entries,
                                       const FolderSynthesisOptions& options);

/// The metadata of a synthesized deployable file: shardema.kind =
/// deployable_weights, shardema.sigma_rel, shardema.gamma (17 digits),
/// shardema.step, shardema.synthesis = raw|normalized.
std::map<std::string, std::string> synthesizedMetadata(const SynthesisWeights& weights,
                                                       bool normalize);

}  // namespace shardema
