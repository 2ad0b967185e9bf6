#pragma once
// The frame every flag-taking subcommand shares: parse the flags, answer
// --help, and report library errors (a missing or corrupt file, a value the
// library refuses) as usage errors, which are the user's input too, so
// main() prints one line and exits 2.
#include <c10/util/Exception.h>

#include <ostream>
#include <string>
#include <vector>

#include "flag_parser.h"

namespace shardema::cli {

/// Parses `args` against `specs` (which should include {"help", kNone}),
/// prints the usage for --help, else returns run(flags, out).
template <typename Run>
int runFlaggedCommand(const std::vector<FlagSpec>& specs, const std::vector<std::string>& args,
                      std::ostream& out, void (*printUsage)(std::ostream&), Run run) {
  const ParsedFlags flags = parseFlags(specs, args);
  if (flags.has("help")) {
    printUsage(out);
    return 0;
  }
  try {
    return run(flags, out);
  } catch (const c10::Error& error) {
    throw UsageError(error.what_without_backtrace());
  }
}

}  // namespace shardema::cli
