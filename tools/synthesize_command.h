#pragma once
// `shardema synthesize`: post-hoc EMA of any sigma_rel from a folder of
// snapshots (synthesis.h), offline and streaming.
#include <ostream>
#include <string>
#include <vector>

namespace shardema::cli {

/// Writes the `shardema synthesize --help` text.
void printSynthesizeUsage(std::ostream& out);

/// Runs `shardema synthesize <args>`: prints each snapshot's weight, then
/// one summary line. Throws UsageError for bad flags and every file or
/// solve problem (naming the file or value), so main() exits 2.
int runSynthesizeCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardema::cli
