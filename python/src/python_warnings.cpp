#include "python_warnings.h"

#include <exception>

#include "python_terms.h"

namespace shardema::python {

void PythonWarnings::Buffer::process(const c10::Warning& warning) {
  messages.push_back(warning.msg());
}

PythonWarnings::PythonWarnings() : previous_(c10::WarningUtils::get_warning_handler()) {
  c10::WarningUtils::set_warning_handler(&buffer_);
}

PythonWarnings::~PythonWarnings() noexcept(false) {
  c10::WarningUtils::set_warning_handler(previous_);
  for (const std::string& message : buffer_.messages) {
    // stacklevel 2: the user's line that called into shardema.
    if (PyErr_WarnEx(PyExc_UserWarning, inPythonTerms(message).c_str(), 2) == 0) continue;
    if (std::uncaught_exceptions() > 0) {
      PyErr_Clear();
      continue;
    }
    throw pybind11::error_already_set();
  }
}

}  // namespace shardema::python
