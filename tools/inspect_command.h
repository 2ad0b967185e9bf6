#pragma once
// `shardema inspect FILE|DIR`: validates a safetensors file or a per-rank
// checkpoint folder and lists what it holds.
#include <ostream>
#include <string>
#include <vector>

namespace shardema::cli {

/// Writes the `shardema inspect --help` text.
void printInspectUsage(std::ostream& out);

/// Runs `shardema inspect <path>`. A file: its size, XXH64, metadata and
/// every tensor (name, dtype, shape). A folder: the manifest (step, world
/// size, schedule, layout), every rank file checked against it (size,
/// XXH64, tensors), and the tensors with their global shapes and ranges.
/// Any problem is a UsageError naming the file (exit status 2).
int runInspectCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardema::cli
