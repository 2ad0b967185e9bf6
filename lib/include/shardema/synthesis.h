#pragma once
// Post-hoc EMA synthesis (Karras et al., Algorithm 3; DESIGN.md section 5): the
// EMA of another sigma_rel, made after training from saved power-function
// snapshots as sum_i w_i snapshot_i.
//
//   into a file     synthesizeSnapshotFolder(dir, outPath, options)
//   into memory     synthesizeSnapshots(entries, options)
//   the weights     solveSynthesisWeights(profiles, sigmaRel, step)
//   the snapshots   scanSnapshotFolder(dir), scanRankSnapshots(dir, rank)
//
// A folder is a rank-0 full-copy one ({i}.{step}.safetensors) or a sharded
// one (rank_{r:05d}/...), which is synthesized rank by rank and merged into
// full tensors on the way out. Floating tensors are the weighted sum,
// accumulated in float64; copies (integer/bool tensors) come from the newest
// snapshot used, as edm2 copies buffers from its last input. Streaming: at
// most bufferBytes of accumulators and one read buffer per snapshot are
// held, whatever the model size, so it runs offline on a machine smaller
// than the job.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/posthoc_synthesis.h"

namespace shardema {

/// What to synthesize, for either destination.
struct SnapshotSynthesisOptions {
  /// Target sigma_rel, in (0, 0.2887). Required.
  double sigmaRel = 0.0;
  /// Target step; 0 (default) = the newest snapshot. Snapshots after it
  /// are left out.
  int64_t step = 0;
  /// edm2 normalisation of the weights (default off: the raw solve).
  bool normalize = false;
  /// dtype of the floating tensors produced: float32 (default), bfloat16 or
  /// float16. Integer/bool tensors (copied buffers) keep theirs.
  c10::ScalarType outputDtype = c10::ScalarType::Float;
  /// Elements accumulated per round are bounded by bufferBytes / 8 (float64
  /// accumulators). Default 64 MiB. Larger: fewer rounds, so fewer and
  /// larger reads of every snapshot (faster on slow storage); costs that
  /// much more host memory for the accumulators and the read buffers.
  int64_t bufferBytes = int64_t{64} << 20;
};

struct FolderSynthesisReport {
  /// The solve, one weight per entry of `files`.
  SynthesisWeights weights;
  /// The snapshot each weight belongs to (rank 0's file for sharded folders:
  /// every rank has the same (profile, step) set).
  std::vector<std::string> files;
  bool sharded = false;
  int64_t worldSize = 0;
  int64_t tensors = 0;
};

/// Synthesizes options.sigmaRel from the snapshots in `dir` and writes the
/// deployable weights to `outPath` (crash-safe; must not be or lie inside
/// `dir`; metadata shardema.kind=deployable_weights, shardema.sigma_rel,
/// shardema.gamma, shardema.step, shardema.synthesis=raw|normalized). What
/// `shardema synthesize` runs. Errors (c10::ValueError naming the folder or
/// file): everything scanSnapshotFolder and solveSynthesisWeights refuse,
/// and snapshots of one folder that disagree on tensor names, shapes or
/// dtypes. Blocks.
FolderSynthesisReport synthesizeSnapshotFolder(const std::string& dir, const std::string& outPath,
                                               const SnapshotSynthesisOptions& options);

struct SynthesizedTensors {
  /// The solve, one weight per input entry (unused ones have weight 0).
  SynthesisWeights weights;
  /// In the newest used snapshot's order, under its names and shapes.
  /// Floating tensors: the weighted sum accumulated in float64, converted
  /// to options.outputDtype; integer/bool tensors: the newest used snapshot's.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
};

/// The same synthesis into memory, over a list of snapshot files (e.g.
/// scanSnapshotFolder(dir).snapshots, or one rank's scanRankSnapshots(dir,
/// r)): what a validation swap or a sigma_rel sweep needs. c10::ValueError
/// as synthesizeSnapshotFolder. Blocks.
SynthesizedTensors synthesizeSnapshots(const std::vector<SnapshotEntry>& entries,
                                       const SnapshotSynthesisOptions& options);

}  // namespace shardema
