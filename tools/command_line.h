#pragma once
// The whole `shardema` command line as a function: main() passes its
// arguments and the standard streams; the CLI tests call it in-process
// (LibTorch's start-up, about 0.5 s a process and 2 s under ASan, would
// otherwise be most of their time), and run the binary itself only to
// check what main adds: the exit status and the real streams.
#include <ostream>
#include <string>
#include <vector>

namespace shardema::cli {

/// Runs `shardema ARGS...` (ARGS without the program name), writing results
/// to `out` and errors to `err`. Returns the exit status: 0 success, 2 a
/// usage or input error (one line on `err`, "shardema <command>: <message>"),
/// 1 anything unexpected. `--version` prints "shardema <versionText()>". Runs the command on the calling thread and
/// returns when it is done (an export or synthesis may take minutes); the
/// caller owns both streams. Library warnings (detail::warn) go to c10's
/// handler, i.e. the process's stderr, not to `err`.
int runCommandLine(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

/// shardema's version, "0.1.0": CMakeLists.txt's project() version, the one
/// source of `shardema --version`, shardema.__version__ and the wheel's.
const char* versionText();

}  // namespace shardema::cli
