#pragma once
// torch.dtype <-> c10::ScalarType at the boundary (LibTorch 1.13 has no
// pybind11 caster for it).
#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

namespace shardema::python {

/// TypeError naming `parameter` when `dtype` is not a torch.dtype.
c10::ScalarType scalarTypeOf(const pybind11::handle& dtype, const char* parameter);
pybind11::object dtypeObject(c10::ScalarType type);

}  // namespace shardema::python
