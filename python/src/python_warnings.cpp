#include "python_warnings.h"

#include <exception>
#include <string>
#include <vector>

#include "python_terms.h"

namespace shardema::python {
namespace {

// The folders of the packages whose frames a warning skips, each ending in
// '/': shardema's and torch's, and Lightning's when it is imported.
const std::vector<std::string>& libraryFolders() {
  static const std::vector<std::string> folders = [] {
    std::vector<std::string> out;
    const pybind11::dict modules = pybind11::module_::import("sys").attr("modules");
    const pybind11::object dirname = pybind11::module_::import("os.path").attr("dirname");
    for (const char* name : {"shardema", "torch", "lightning", "pytorch_lightning"}) {
      if (!modules.contains(name)) continue;
      const pybind11::object file = modules[name].attr("__dict__").attr("get")("__file__");
      if (file.is_none()) continue;
      out.push_back(pybind11::cast<std::string>(dirname(file)) + "/");
    }
    return out;
  }();
  return folders;
}

bool inLibrary(PyFrameObject* frame) {
  PyCodeObject* code = PyFrame_GetCode(frame);  // a new reference
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  Py_DECREF(code);
  if (file == nullptr) {
    PyErr_Clear();
    return false;
  }
  const std::string path(file);
  for (const std::string& folder : libraryFolders()) {
    if (path.compare(0, folder.size(), folder) == 0) return true;
  }
  return false;
}

}  // namespace

int userStackLevel() {
  int level = 1;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the binding's caller
  if (frame == nullptr) return 1;
  Py_INCREF(frame);
  while (frame != nullptr && inLibrary(frame)) {
    PyFrameObject* back = PyFrame_GetBack(frame);  // a new reference, or null
    Py_DECREF(frame);
    frame = back;
    ++level;
  }
  if (frame == nullptr) return 2;  // nothing outside the libraries: the caller's caller
  Py_DECREF(frame);
  return level;
}

void PythonWarnings::Buffer::process(const c10::Warning& warning) {
  messages.push_back(warning.msg());
}

PythonWarnings::PythonWarnings() : previous_(c10::WarningUtils::get_warning_handler()) {
  c10::WarningUtils::set_warning_handler(&buffer_);
}

PythonWarnings::~PythonWarnings() noexcept(false) {
  c10::WarningUtils::set_warning_handler(previous_);
  for (const std::string& message : buffer_.messages) {
    // The user's line that led into shardema.
    if (PyErr_WarnEx(PyExc_UserWarning, inPythonTerms(message).c_str(), userStackLevel()) == 0) {
      continue;
    }
    if (std::uncaught_exceptions() > 0) {
      PyErr_Clear();
      continue;
    }
    throw pybind11::error_already_set();
  }
}

}  // namespace shardema::python
