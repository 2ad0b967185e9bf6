#pragma once
// Runs the real `shardema` binary (SHARDEMA_CLI_PATH) for the CLI tests and
// keeps its exit status, stdout and stderr apart.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "support/command_output.h"
#include "support/file_bytes.h"

namespace shardema::testing {

struct CliResult {
  int status = -1;
  std::string out;
  std::string err;
};

// Arguments go through the shell as written; test paths need no quoting.
inline CliResult runCli(const std::string& args) {
  char errPath[] = "/tmp/shardema_cli_test_XXXXXX";
  const int fd = ::mkstemp(errPath);
  EXPECT_GE(fd, 0);
  ::close(fd);
  const CommandResult run =
      runCommand(std::string(SHARDEMA_CLI_PATH) + " " + args + " 2>" + errPath);
  CliResult result;
  result.status = run.exitCode;
  result.out = run.output;
  result.err = readFileBytes(errPath);
  std::remove(errPath);
  return result;
}

}  // namespace shardema::testing
