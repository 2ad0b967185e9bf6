#pragma once
// torch.dtype <-> c10::ScalarType at the boundary, with a message naming
// the argument when the object is not a torch.dtype.
#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

namespace shardema::python {

/// TypeError naming `parameter` when `dtype` is not a torch.dtype.
c10::ScalarType scalarTypeOf(const pybind11::handle& dtype, const char* parameter);
pybind11::object dtypeObject(c10::ScalarType type);

}  // namespace shardema::python
