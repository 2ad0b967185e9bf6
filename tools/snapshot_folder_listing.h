#pragma once
// `shardema inspect` of a post-hoc snapshot folder, and the one-line
// summary `export` gives when it is handed one.
#include <ostream>
#include <string>

namespace shardema::cli {

/// Validates the post-hoc snapshot folder `dir` as synthesis reads it
/// (scanSnapshotFolder: names, metadata, one world size and layout, the same
/// snapshots on every rank), every file's tensor checksums, and that every
/// snapshot of a rank holds the same tensors (names, dtypes, shapes) as its
/// first; then lists the layout, each profile's sigma_rel, gamma and steps,
/// every file and the tensors. UsageError naming the file otherwise.
void printSnapshotFolder(const std::string& dir, std::ostream& out);

/// "post-hoc snapshot folder DIR (sharded over 2 ranks, 6 snapshots of
/// sigma_rel 0.05, 0.1, steps 10-30)", from the file names and headers.
std::string describeSnapshotFolder(const std::string& dir);

}  // namespace shardema::cli
