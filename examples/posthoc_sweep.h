#pragma once
// The demo's post-hoc sweep: after training, the snapshots the
// PostHocCallback wrote are combined into the EMA of any sigma_rel
// (synthesizeSnapshots), so one run can compare many averaging lengths on
// held-out data without retraining.
#include <cstddef>
#include <string>
#include <vector>

#include "demo_task.h"
#include "shardema/shard/communicator.h"
#include "shardema/shard/shard_layout.h"

namespace shardema::demo {

/// One sigma_rel of the sweep.
struct SweepRow {
  double sigmaRel = 0;
  /// Held-out MSE of the synthesized weights (clean targets, eval mode).
  double heldOutLoss = 0;
  /// 1-norm condition number of the synthesis solve; large values mean the
  /// saved profiles pin this sigma_rel down poorly (few snapshots, or a
  /// sigma_rel far from the trained ones).
  double conditionNumber = 0;
  bool badlyConditioned = false;
};

/// Collective over `comm`. For each sigma_rel of `grid`, in order: every
/// rank synthesizes its own shards from its rank folder of the sharded
/// snapshot folder `snapshotFolder` (at the newest snapshot), rank 0
/// gathers them into full tensors (`layout`: the PostHocCallback's) and
/// measures the held-out loss of a scratch copy of `model`'s architecture
/// with those weights loaded (strictly: every tensor must come from the
/// synthesis). No rank reads another's files. `model` is not touched.
/// Returns the rows on rank 0, nothing on the others. c10::ValueError from
/// scanRankSnapshots / synthesizeSnapshots; a rank that fails makes every
/// rank fail in the gather. Blocks.
std::vector<SweepRow> sweepSigmaRel(shard::Communicator& comm, const shard::ShardLayout& layout,
                                    const std::string& snapshotFolder,
                                    const std::vector<double>& grid, const Student& model,
                                    const RegressionTask& task);

/// Index of the row with the lowest held-out loss (the first on ties);
/// `rows` must not be empty.
size_t bestSweepRow(const std::vector<SweepRow>& rows);

/// Removes the snapshot files ("{i}.{step}.safetensors") a previous run left
/// in `snapshotFolder` and in its rank_NNNNN folders, and nothing else: the sweep synthesizes at
/// the newest snapshot, which would otherwise belong to a longer earlier run. Returns how many were
/// removed; a missing folder is not an error.
int removeStaleSnapshots(const std::string& snapshotFolder);

}  // namespace shardema::demo
