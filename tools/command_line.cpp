#include "command_line.h"

#include <c10/util/Exception.h>

#include <iomanip>
#include <ostream>

#include "export_command.h"
#include "flag_parser.h"
#include "inspect_command.h"
#include "plan_command.h"
#include "schedule_command.h"
#include "synthesize_command.h"

#ifndef SHARDEMA_VERSION
#error "tools/CMakeLists.txt defines SHARDEMA_VERSION, the project's version"
#endif

namespace shardema::cli {
namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args, std::ostream& out);
};

// Adding a subcommand: write <name>_command.{h,cpp} with a run function that
// throws UsageError naming the flag, list it here and in tools/CMakeLists.txt
// (shardema_cli_commands).
const Command kCommands[] = {
    {"schedule", "print EMA decay values of a schedule, or the step it reaches a target",
     runScheduleCommand},
    {"export", "merge a per-rank checkpoint into deployable weights, or reshard it",
     runExportCommand},
    {"inspect", "validate a safetensors file or checkpoint folder and list its contents",
     runInspectCommand},
    {"synthesize", "post-hoc EMA of any sigma_rel from a folder of power-function snapshots",
     runSynthesizeCommand},
    {"plan", "host memory, PCIe traffic, cores and step overhead of the EMA per node, on paper",
     runPlanCommand},
};

void printUsage(std::ostream& out) {
  out << "usage: shardema <command> [flags]    (shardema <command> --help for its flags)\n"
         "       shardema --version\n\n"
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

int runCommand(const Command& command, const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err) {
  const std::string prefix = std::string("shardema ") + command.name + ": ";
  try {
    return command.run(args, out);
  } catch (const UsageError& error) {
    err << prefix << oneLine(error.what()) << '\n';
    return 2;
  } catch (const c10::ValueError& error) {
    // A bad value the command did not map to a flag: still the user's input.
    err << prefix << oneLine(error.what_without_backtrace()) << '\n';
    return 2;
  } catch (const c10::Error& error) {
    err << prefix << "internal error: " << oneLine(error.what_without_backtrace()) << '\n';
    return 1;
  } catch (const std::exception& error) {
    err << prefix << "internal error: " << oneLine(error.what()) << '\n';
    return 1;
  }
}

}  // namespace

const char* versionText() { return SHARDEMA_VERSION; }

int runCommandLine(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  if (args.empty()) {
    printUsage(err);
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    printUsage(out);
    return 0;
  }
  if (args[0] == "--version") {
    out << "shardema " << versionText() << '\n';
    return 0;
  }
  for (const Command& command : kCommands) {
    if (args[0] == command.name) {
      return runCommand(command, std::vector<std::string>(args.begin() + 1, args.end()), out, err);
    }
  }
  err << "shardema: unknown command '" << args[0] << "' (see shardema --help)\n";
  return 2;
}

}  // namespace shardema::cli
