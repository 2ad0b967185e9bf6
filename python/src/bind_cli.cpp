// The `shardema` command line inside the extension: the console script that
// `pip install .` puts on the PATH (shardema/_cli.py) runs the CLI's own
// commands (tools/command_line.h) here, so they live once, in tools/, and the
// installed command needs no LibTorch of its own: torch's Python package
// has loaded it by then.
#include <torch/csrc/utils/pybind.h>

#include <sstream>
#include <string>
#include <vector>

#include "bindings.h"
#include "command_line.h"

namespace py = pybind11;

namespace shardema::python {

void bindCommandLine(py::module_& m) {
  m.attr("version") = cli::versionText();
  m.def(
      "run_command_line",
      [](const std::vector<std::string>& args) {
        std::ostringstream out;
        std::ostringstream err;
        int status = 0;
        {
          // An export or synthesis may take minutes: other Python threads
          // run meanwhile. Warnings go to stderr, as from the C++ binary.
          py::gil_scoped_release release;
          status = cli::runCommandLine(args, out, err);
        }
        return py::make_tuple(status, out.str(), err.str());
      },
      py::arg("args"),
      "Runs `shardema ARGS...`: (exit status, what it wrote to stdout, to stderr)");
}

}  // namespace shardema::python
