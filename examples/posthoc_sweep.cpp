#include "posthoc_sweep.h"

#include <c10/util/Exception.h>

#include <exception>
#include <filesystem>
#include <map>
#include <system_error>

#include "shardema/core/posthoc_snapshot.h"
#include "shardema/module_tracking.h"
#include "shardema/shard/gather.h"
#include "shardema/synthesis.h"

namespace shardema::demo {

namespace {

// This rank's synthesized shards of `sigmaRel`, 1-D, in layout order; on
// failure the error text, so the gather fails every rank together.
std::vector<at::Tensor> synthesizedShards(const std::string& snapshotFolder, int64_t rank,
                                          const shard::ShardLayout& layout, double sigmaRel,
                                          shard::GatherOptions& gather, SweepRow& row) {
  std::vector<at::Tensor> pieces;
  try {
    const std::vector<SnapshotEntry> entries = scanRankSnapshots(snapshotFolder, rank);
    SnapshotSynthesisOptions options;
    options.sigmaRel = sigmaRel;
    options.step = 0;  // the newest snapshot: the end of training
    const SynthesizedTensors synthesized = synthesizeSnapshots(entries, options);
    std::map<std::string, at::Tensor> byName(synthesized.tensors.begin(),
                                             synthesized.tensors.end());
    for (const shard::ShardSpec& spec : layout.specs) {
      TORCH_CHECK_VALUE(byName.count(spec.name) == 1, "sweepSigmaRel: the snapshots hold no '",
                        spec.name, "'");
      pieces.push_back(byName.at(spec.name).reshape({-1}));
    }
    row.conditionNumber = synthesized.weights.conditionNumber;
    row.badlyConditioned = synthesized.weights.badlyConditioned;
  } catch (const std::exception& e) {
    gather.localError = e.what();
    pieces.clear();
  }
  return pieces;
}

}  // namespace

std::vector<SweepRow> sweepSigmaRel(shard::Communicator& comm, const shard::ShardLayout& layout,
                                    const std::string& snapshotFolder,
                                    const std::vector<double>& grid, const Student& model,
                                    const RegressionTask& task) {
  // A scratch module rather than the trained one: the caller keeps using the
  // raw weights after the sweep, and a fresh module holds no raw value that a
  // tensor missing from the snapshots could silently leave in place (the
  // strict load below rejects that case instead).
  const auto& layer = model->fc1->options;
  Student scratch(layer.in_features(), layer.out_features());
  std::vector<SweepRow> rows;
  for (const double sigmaRel : grid) {
    SweepRow row;
    row.sigmaRel = sigmaRel;
    shard::GatherOptions gather;  // to rank 0
    const std::vector<at::Tensor> pieces =
        synthesizedShards(snapshotFolder, comm.rank(), layout, sigmaRel, gather, row);
    const auto full = shard::gatherFull(comm, layout, pieces, gather);
    if (comm.rank() != 0) continue;
    loadIntoModule(*scratch, full, LoadStrictness::kStrict);
    row.heldOutLoss = heldOutLoss(scratch, task);
    rows.push_back(row);
  }
  return rows;
}

size_t bestSweepRow(const std::vector<SweepRow>& rows) {
  TORCH_CHECK_VALUE(!rows.empty(), "bestSweepRow: expected at least one row, found none");
  size_t best = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    if (rows[i].heldOutLoss < rows[best].heldOutLoss) best = i;
  }
  return best;
}

int removeStaleSnapshots(const std::string& snapshotFolder) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_directory(snapshotFolder, error)) return 0;
  int removed = 0;
  // Only names the snapshot format owns: --out may point at a folder that
  // holds other files too.
  const auto removeIn = [&removed](const fs::path& folder) {
    for (const auto& entry : fs::directory_iterator(folder)) {
      if (entry.is_regular_file() &&
          parseSnapshotFileName(entry.path().filename().string(), nullptr, nullptr)) {
        fs::remove(entry.path());
        ++removed;
      }
    }
  };
  removeIn(snapshotFolder);
  std::vector<fs::path> rankFolders;
  for (const auto& entry : fs::directory_iterator(snapshotFolder)) {
    if (entry.is_directory() && entry.path().filename().string().rfind("rank_", 0) == 0) {
      rankFolders.push_back(entry.path());
    }
  }
  for (const fs::path& folder : rankFolders) {
    removeIn(folder);
    // An empty rank folder of an earlier, larger world size would make the
    // folder look sharded over too many ranks.
    if (fs::is_empty(folder, error)) fs::remove(folder, error);
  }
  return removed;
}

}  // namespace shardema::demo
