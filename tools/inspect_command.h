#pragma once
// `shardema inspect FILE|DIR`: validates a safetensors file, a per-rank
// checkpoint folder or a post-hoc snapshot folder and lists what it holds.
#include <ostream>
#include <string>
#include <vector>

namespace shardema::cli {

/// Writes the `shardema inspect --help` text.
void printInspectUsage(std::ostream& out);

/// Runs `shardema inspect <path>`. A file: every tensor's checksum and, for
/// an Averager state, its metadata as Averager::load checks it; then its
/// size, XXH64, metadata and every tensor (name, dtype, shape). A folder:
/// inspectCheckpoint (the manifest; every rank file's size, XXH64,
/// metadata, tensors and tensor checksums), then the manifest (step, world
/// size, schedule, layout) and the tensors with their global shapes and
/// ranges. A post-hoc snapshot folder: printSnapshotFolder. A DCP folder
/// (which the Python package's `shardema` reads): refused, naming it. Any
/// problem is a UsageError naming the file (exit status 2).
int runInspectCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardema::cli
