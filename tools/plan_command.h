#pragma once
// `shardema plan`: the per-node model of shardema/core/node_plan.h for the
// user's own node, one row per model size and world size.
#include <ostream>
#include <string>
#include <vector>

namespace shardema::cli {

/// Writes the `shardema plan --help` text.
void printPlanUsage(std::ostream& out);

/// Runs `shardema plan <args>`: a line naming the inputs, then a markdown
/// table (or, with --format json, one JSON object per row) of planNode for
/// every --parameters x --ranks pair, in the order given. Throws UsageError
/// naming the flag on bad input (planNode's ValueErrors are mapped back to
/// their flag); returns the exit status (0). Runs on the calling thread.
int runPlanCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace shardema::cli
