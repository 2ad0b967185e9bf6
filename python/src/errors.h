#pragma once
// How C++ errors reach Python: c10's typed errors become the Python
// exception that fits, with the C++ message (no C++ backtrace). For this
// module's functions only; torch's keep torch's translation.
#include <pybind11/pybind11.h>

namespace shardema::python {

/// c10::ValueError -> ValueError, c10::TypeError -> TypeError,
/// c10::IndexError -> IndexError, c10::NotImplementedError ->
/// NotImplementedError, any other c10::Error -> RuntimeError.
void registerErrorTranslation();

}  // namespace shardema::python
