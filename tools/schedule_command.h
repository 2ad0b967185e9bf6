#pragma once
// `shardema schedule`: evaluate a DecaySchedule from the command line.
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "shardema/core/decay_schedule.h"

namespace shardema::cli {

/// Writes the `shardema schedule --help` text.
void printScheduleUsage(std::ostream& out);

/// Runs `shardema schedule <args>`: prints "n value" (%.17g) for every step
/// of --steps, then "reach <target> <n|never>" for every --reach target.
/// Throws UsageError naming the flag on bad input (library ValueErrors are
/// translated to name the flag too); returns the exit status (0).
int runScheduleCommand(const std::vector<std::string>& args, std::ostream& out);

/// Largest step firstStepReaching() looks at: 2^62.
constexpr int64_t kReachCap = int64_t(1) << 62;

/// First 1-based step n <= kReachCap with schedule.decayAt(n) >= target, or
/// nullopt. Exponential then binary search, so it relies on decayAt being
/// non-decreasing in n, which holds for every kind (see the .cpp).
std::optional<int64_t> firstStepReaching(const DecaySchedule& schedule, double target);

}  // namespace shardema::cli
