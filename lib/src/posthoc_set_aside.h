#pragma once
// The snapshots a resumed post-hoc run supersedes (PostHocCallback's resume,
// DESIGN.md section 4), and moving them out of the synthesis set. Not
// installed.
//
// The synthesis reads every `{i}.{step}.safetensors` directly in a snapshot
// folder. A run resumed at call c goes on writing its own snapshots, so at
// c the folder must hold what the uninterrupted run held there: the
// snapshots at multiples of checkpointEvery up to c. Two kinds of file
// would join the synthesis otherwise:
//   - the final snapshot a finished run wrote at c off that grid (onTrainEnd
//     writes one at the last call): extending the run from its last
//     checkpoint would mix it into the longer run's synthesis;
//   - snapshots past c, of a run that went further than the checkpoint it
//     is resumed from: the resumed run replaces some of them and keeps the
//     others beside its own.
// Both are moved, never deleted or overwritten.
#include <cstdint>
#include <string>
#include <vector>

namespace shardema::detail {

/// Subfolder of a snapshot folder that takes superseded snapshots, one
/// `resumed_at_{calls}` folder per resume (`_2`, `_3`, ... when a resume at
/// the same call already made one). The synthesis does not read it.
constexpr const char* kSupersededFolder = "superseded";

struct SetAsideSnapshots {
  /// Snapshot file names moved into the resume folder (the final snapshot
  /// of a finished run at the resumed call: it is that call's resume state).
  std::vector<std::string> intoResumeFolder;
  /// Snapshot file names moved into `supersededFolder`.
  std::vector<std::string> superseded;
  /// Where `superseded` went ("" when nothing did).
  std::string supersededFolder;
  bool empty() const { return intoResumeFolder.empty() && superseded.empty(); }
};

/// Moves out of `snapshotFolder` (one rank's: the layout's folder, or its
/// rank_NNNNN subfolder) every snapshot of a call after `calls`, and the
/// snapshots at `calls` when `calls` is not a multiple of `checkpointEvery`.
/// The latter go to `resumeFolder` under their own names, where a later
/// resume at `calls` finds them; where the resume folder already holds that
/// name (the checkpoint's own resume state, the same EMA), to the superseded
/// folder like the rest. Files are renamed (never replaced: an existing
/// target is an error), then the folders are fsynced. A missing snapshot
/// folder moves nothing. c10::Error naming the file on failure; files moved
/// before it stay moved. Blocks; the caller's thread.
SetAsideSnapshots setAsideSupersededSnapshots(const std::string& snapshotFolder,
                                              const std::string& resumeFolder, int64_t calls,
                                              int64_t checkpointEvery);

/// One line for the warning that reports `moved` (folder names included).
std::string describeSetAside(const std::string& snapshotFolder, const std::string& resumeFolder,
                             int64_t calls, const SetAsideSnapshots& moved);

}  // namespace shardema::detail
