#pragma once
// Runs a command through /bin/sh and keeps what it writes to stdout: for the
// tests that run the venv's Python (tests/python/) on our files.
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace shardema::testing {

struct CommandResult {
  int exitCode = -1;  // -1: it did not start, or did not exit normally
  std::string output;
};

inline CommandResult runCommand(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, got);
  const int status = ::pclose(pipe);
  result.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// python3 tests/python/<script> <path>, with stderr in the output.
inline CommandResult runPythonScript(const std::string& script, const std::string& path) {
  return runCommand(std::string("'") + SHARDEMA_TEST_PYTHON + "' '" + SHARDEMA_TEST_SOURCE_DIR +
                    "/python/" + script + "' '" + path + "' 2>&1");
}

}  // namespace shardema::testing
