#include "dtype.h"

#include <c10/util/Exception.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>

#include <string>

namespace shardema::python {

c10::ScalarType scalarTypeOf(const pybind11::handle& dtype, const char* parameter) {
  TORCH_CHECK_TYPE(THPDtype_Check(dtype.ptr()), parameter, " must be a torch.dtype, got ",
                   std::string(pybind11::str(pybind11::type::of(dtype))));
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

pybind11::object dtypeObject(c10::ScalarType type) {
  return pybind11::reinterpret_borrow<pybind11::object>(
      reinterpret_cast<PyObject*>(torch::getTHPDtype(type)));
}

}  // namespace shardema::python
