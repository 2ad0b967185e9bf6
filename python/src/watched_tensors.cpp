#include "watched_tensors.h"

#include <torch/csrc/autograd/python_variable.h>

#include <string>

namespace shardema::python {

namespace py = pybind11;

std::vector<int64_t> replacedWatched(const py::list& watched) {
  std::vector<int64_t> replaced;
  const Py_ssize_t count = PyList_GET_SIZE(watched.ptr());
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* entry = PyList_GET_ITEM(watched.ptr(), i);  // borrowed
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4 ||
        !PyDict_Check(PyTuple_GET_ITEM(entry, 0))) {
      throw py::type_error("watched[" + std::to_string(i) +
                           "]: expected a (container dict, key, tensor, index) tuple");
    }
    PyObject* held = PyDict_GetItemWithError(PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1));
    if (held == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (held != PyTuple_GET_ITEM(entry, 2)) replaced.push_back(i);  // gone or another object
  }
  return replaced;
}

std::vector<bool> trainableFlags(const py::list& deciders) {
  const Py_ssize_t count = PyList_GET_SIZE(deciders.ptr());
  std::vector<bool> flags(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* tensor = PyList_GET_ITEM(deciders.ptr(), i);  // borrowed
    if (!THPVariable_Check(tensor)) {
      throw py::type_error("deciders[" + std::to_string(i) + "]: expected a tensor, got " +
                           std::string(Py_TYPE(tensor)->tp_name));
    }
    flags[static_cast<size_t>(i)] = THPVariable_Unpack(tensor).requires_grad();
  }
  return flags;
}

}  // namespace shardema::python
