#include "folder_kind.h"

#include <string>
#include <vector>

#include "shardema/core/file_system.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/sharded_checkpoint.h"

namespace shardema::cli {
namespace {

bool endsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "rank_00003" exactly (five digits or more, as rankFolderName writes).
bool isRankFolderName(const std::string& name) {
  if (name.rfind("rank_", 0) != 0 || name.size() < 10) return false;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  return true;
}

std::string childPath(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace

FolderKind folderKind(const std::string& dir) {
  const std::vector<std::string> names = detail::directoryNames(dir, nullptr);
  bool dcp = false;
  bool snapshots = false;
  for (const std::string& name : names) {
    if (name == kManifestFileName) return FolderKind::kRankCheckpoint;
    // DCP writes .metadata last (its commit) and __{rank}_{i}.distcp data.
    if (name == ".metadata" || endsWith(name, ".distcp")) dcp = true;
    if (parseSnapshotFileName(name, nullptr, nullptr)) snapshots = true;
    if (isRankFolderName(name) && detail::isDirectory(childPath(dir, name))) snapshots = true;
  }
  if (dcp) return FolderKind::kDcpCheckpoint;
  if (snapshots) return FolderKind::kPostHocSnapshots;
  return FolderKind::kUnknown;
}

std::string dcpFolderRefusal(const std::string& dir) {
  return dir +
         ": a torch.distributed.checkpoint (DCP) folder (.metadata + .distcp files), whose format "
         "is torch's: the `shardema` that `pip install .` puts on the PATH reads its EMA through "
         "torch's reader";
}

}  // namespace shardema::cli
