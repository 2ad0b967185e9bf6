// `shardema <command> [flags]`: see command_line.h; one file per subcommand.
#include <iostream>
#include <string>
#include <vector>

#include "command_line.h"

int main(int argc, char** argv) {
  return shardema::cli::runCommandLine(std::vector<std::string>(argv + 1, argv + argc), std::cout,
                                       std::cerr);
}
