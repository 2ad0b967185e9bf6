#pragma once
// What a folder given to `shardema inspect` or `export` is, from its names
// alone: each kind is read by its own code, and a folder of another kind is
// refused in one line saying what it is instead of "manifest.json missing".
#include <string>

namespace shardema::cli {

enum class FolderKind {
  /// shardema's per-rank checkpoint: manifest.json (save_checkpoint,
  /// saveCheckpoint, export --world-size).
  kRankCheckpoint,
  /// torch.distributed.checkpoint: .metadata (a pickle) plus .distcp files.
  /// Its EMA is read by the Python package's `shardema` (torch's reader).
  kDcpCheckpoint,
  /// Post-hoc EMA snapshots: {i}.{step}.safetensors files or rank_NNNNN/
  /// folders of them (PostHocEMA, PostHocCallback).
  kPostHocSnapshots,
  /// None of these (empty, or foreign): read as a per-rank checkpoint, whose
  /// error names the missing manifest.
  kUnknown,
};

/// Classifies folder `dir` by the names of its entries (reads the folder,
/// not the files). A manifest wins over the others.
FolderKind folderKind(const std::string& dir);

/// The one-line refusal for a DCP folder given to the C++ `shardema`:
/// names the folder and what reads it.
std::string dcpFolderRefusal(const std::string& dir);

}  // namespace shardema::cli
