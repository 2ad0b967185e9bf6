// `shardema <command> [flags]`: dispatches to one file per subcommand.
// Exit status: 0 success, 2 usage or input error (one line on stderr,
// "shardema <command>: <message>"), 1 anything unexpected.
#include <c10/util/Exception.h>

#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include "export_command.h"
#include "flag_parser.h"
#include "inspect_command.h"
#include "schedule_command.h"
#include "synthesize_command.h"

namespace {

using shardema::cli::UsageError;

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args, std::ostream& out);
};

// Adding a subcommand: write <name>_command.{h,cpp} with a run function that
// throws UsageError naming the flag, list it here and in tools/CMakeLists.txt.
const Command kCommands[] = {
    {"schedule", "print EMA decay values of a schedule, or the step it reaches a target",
     shardema::cli::runScheduleCommand},
    {"export", "merge a per-rank checkpoint into deployable weights, or reshard it",
     shardema::cli::runExportCommand},
    {"inspect", "validate a safetensors file or checkpoint folder and list its contents",
     shardema::cli::runInspectCommand},
    {"synthesize", "post-hoc EMA of any sigma_rel from a folder of power-function snapshots",
     shardema::cli::runSynthesizeCommand},
};

void printUsage(std::ostream& out) {
  out << "usage: shardema <command> [flags]    (shardema <command> --help for its flags)\n\n"
         "commands:\n";
  for (const Command& command : kCommands) {
    out << "  " << std::left << std::setw(12) << command.name << command.summary << '\n';
  }
}

// One line always: a library message never spans lines on stderr.
std::string oneLine(std::string message) {
  for (char& c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return message;
}

int runCommand(const Command& command, const std::vector<std::string>& args) {
  const std::string prefix = std::string("shardema ") + command.name + ": ";
  try {
    return command.run(args, std::cout);
  } catch (const UsageError& error) {
    std::cerr << prefix << oneLine(error.what()) << '\n';
    return 2;
  } catch (const c10::ValueError& error) {
    // A bad value the command did not map to a flag: still the user's input.
    std::cerr << prefix << oneLine(error.what_without_backtrace()) << '\n';
    return 2;
  } catch (const c10::Error& error) {
    std::cerr << prefix << "internal error: " << oneLine(error.what_without_backtrace()) << '\n';
    return 1;
  } catch (const std::exception& error) {
    std::cerr << prefix << "internal error: " << oneLine(error.what()) << '\n';
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    printUsage(std::cerr);
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    printUsage(std::cout);
    return 0;
  }
  for (const Command& command : kCommands) {
    if (args[0] == command.name) {
      return runCommand(command, std::vector<std::string>(args.begin() + 1, args.end()));
    }
  }
  std::cerr << "shardema: unknown command '" << args[0] << "' (see shardema --help)\n";
  return 2;
}
