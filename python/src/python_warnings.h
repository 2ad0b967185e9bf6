#pragma once
// PythonWarnings: for the length of one binding call, shardema's warnings
// (detail::warn, c10's TORCH_WARN underneath) on the calling thread become
// Python warnings (UserWarning) instead of lines on stderr, so
// `warnings.filterwarnings` and pytest see them. Construct it with the GIL
// held, before releasing it (Release in the bindings does); it hands the
// collected warnings to Python when it goes, with the GIL held again.
// Warnings of worker threads still go to c10's default handler (stderr):
// c10 keeps the handler per thread.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace shardema::python {

class PythonWarnings {
 public:
  PythonWarnings();
  /// Issues the collected warnings; a warning turned into an error by the
  /// warnings filter raises, unless an exception is already on its way out
  /// (then the call's own error wins and the warning is dropped).
  ~PythonWarnings() noexcept(false);
  PythonWarnings(const PythonWarnings&) = delete;
  PythonWarnings& operator=(const PythonWarnings&) = delete;

 private:
  struct Buffer : c10::WarningHandler {
    void process(const c10::Warning& warning) override;
    std::vector<std::string> messages;
  };
  Buffer buffer_;
  c10::WarningHandler* previous_;
};

/// The stacklevel of PyErr_WarnEx that names the user's line: the first
/// frame, from the caller of the binding outwards, whose file is not in the
/// shardema, torch or Lightning packages (a warning of an update that
/// torch's optimizer hook or a callback made points at the user's
/// optimizer.step() or trainer.fit(), not at their internals). Needs the GIL.
int userStackLevel();

/// Every call that waits, copies or communicates: Python warnings, then the
/// GIL released for the call.
using Release = pybind11::call_guard<PythonWarnings, pybind11::gil_scoped_release>;

}  // namespace shardema::python
