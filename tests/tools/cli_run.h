#pragma once
// Runs `shardema ARGS` for the CLI tests and keeps its exit status, stdout
// and stderr apart: in-process through cli::runCommandLine (runCli), or as
// the real binary SHARDEMA_CLI_PATH (runCliProcess; cli_process_test.cpp
// checks that both give the same).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "command_line.h"

#include "support/command_output.h"
#include "support/file_bytes.h"

namespace shardema::testing {

struct CliResult {
  int status = -1;
  std::string out;
  std::string err;
};

// `args` split at white space (test paths have none), run in this process.
inline CliResult runCli(const std::string& args) {
  std::istringstream words(args);
  std::vector<std::string> argv;
  for (std::string word; words >> word;) argv.push_back(word);
  std::ostringstream out;
  std::ostringstream err;
  CliResult result;
  result.status = cli::runCommandLine(argv, out, err);
  result.out = out.str();
  result.err = err.str();
  return result;
}

// The binary itself; arguments go through the shell as written.
inline CliResult runCliProcess(const std::string& args) {
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
