#pragma once
// `shardema export`: merge a per-rank checkpoint folder into one deployable
// safetensors file, or reshard it to another world size, offline and
// streaming (sharded_checkpoint.h).
#include <c10/core/ScalarType.h>

#include <ostream>
#include <string>
#include <vector>

namespace shardema::cli {

/// Writes the `shardema export --help` text.
void printExportUsage(std::ostream& out);

/// The --dtype flag of export and synthesize: f32, bf16 or f16 (UsageError
/// otherwise).
c10::ScalarType parseDtype(const std::string& text);

/// Runs `shardema export <args>`: prints one summary line. Throws UsageError
/// for bad flags and for every file problem (a missing or corrupt
/// checkpoint, an unwritable output), naming the file, so main() exits 2.
int runExportCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardema::cli
