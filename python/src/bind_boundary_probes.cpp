// Probes of the C++ -> Python error boundary, for
// tests/python/test_error_boundary.py (and bench/gpu/run.sh's fingerprint);
// not part of the API.
//   _C._throw(kind, message, number): throws from C++, in this module or
//       inside ATen, the error of `kind`, so the test sees each translation
//       (errors.cpp) end to end. The message is formatted here, by this
//       module's C++ runtime, with a double in it ("got 1.5").
//   _C._Failpoint(name, first, second): arms a failpoint of
//       core/include/shardema/core/failpoint.h until close(), to fire where
//       its two values are `first` and `second` (a step and a chunk; a
//       negative `second` matches any).
//   _C._runtime_bindings(): which library each C++ runtime function this
//       module calls was bound to by the dynamic loader (dladdr of the
//       address this module's GOT holds).
#include <ATen/ATen.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <torch/csrc/utils/pybind.h>
#include <unwind.h>

#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "shardema/core/failpoint.h"

// exception_ptr's reference counting is private to std::exception_ptr: named
// here by its mangled names to take its address as this module binds it.
extern "C" void shardemaExceptionPtrAddref() __asm__("_ZNSt15__exception_ptr13exception_ptr9_M_addrefEv");
extern "C" void shardemaExceptionPtrRelease() __asm__(
    "_ZNSt15__exception_ptr13exception_ptr10_M_releaseEv");

namespace py = pybind11;

namespace shardema::python {
namespace {

void throwKind(const std::string& kind, const std::string& message, double number) {
  TORCH_CHECK_VALUE(kind != "value", message, " ", number);
  TORCH_CHECK_TYPE(kind != "type", message, " ", number);
  TORCH_CHECK_INDEX(kind != "index", message, " ", number);
  TORCH_CHECK_NOT_IMPLEMENTED(kind != "not_implemented", message, " ", number);
  TORCH_CHECK(kind != "error", message, " ", number);
  if (kind == "aten") {
    // Thrown inside libtorch_cpu (a view of 2 elements as 3): ATen's own
    // c10::Error, message and all.
    (void)at::ones({2}).view({3});
  }
  if (kind == "std") throw std::runtime_error(message);
  TORCH_CHECK_VALUE(false, "_throw: unknown kind '", kind,
                    "' (value, type, index, not_implemented, error, aten, std)");
}

// The library that holds `address`, "" when none does.
std::string libraryOf(const void* address) {
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

template <typename F>
const void* addressOf(F* function) {
  return reinterpret_cast<const void*>(function);
}

py::dict runtimeBindings() {
  py::dict out;
  out["__cxa_throw"] = libraryOf(addressOf(&__cxxabiv1::__cxa_throw));
  out["__cxa_rethrow"] = libraryOf(addressOf(&__cxxabiv1::__cxa_rethrow));
  out["__cxa_begin_catch"] = libraryOf(addressOf(&__cxxabiv1::__cxa_begin_catch));
  out["__cxa_allocate_exception"] = libraryOf(addressOf(&__cxxabiv1::__cxa_allocate_exception));
  out["_Unwind_RaiseException"] = libraryOf(addressOf(&_Unwind_RaiseException));
  out["_Unwind_Resume"] = libraryOf(addressOf(&_Unwind_Resume));
  out["std::rethrow_exception"] = libraryOf(addressOf(&std::rethrow_exception));
  out["std::current_exception"] = libraryOf(addressOf(&std::current_exception));
  out["std::exception_ptr::_M_addref"] = libraryOf(addressOf(&shardemaExceptionPtrAddref));
  out["std::exception_ptr::_M_release"] = libraryOf(addressOf(&shardemaExceptionPtrRelease));
  out["this module"] = libraryOf(addressOf(&libraryOf));
  return out;
}

class ArmedFailpoint {
 public:
  ArmedFailpoint(const std::string& name, int64_t first, int64_t second)
      : armed_(std::make_unique<failpoint::Armed>(name, [first, second](int64_t a, int64_t b) {
          return a == first && (second < 0 || b == second);
        })) {}
  int64_t fired() const { return armed_ ? armed_->fired() : 0; }
  void close() { armed_.reset(); }

 private:
  std::unique_ptr<failpoint::Armed> armed_;
};

}  // namespace

void bindBoundaryProbes(py::module_& m) {
  m.def("_throw", &throwKind, py::arg("kind"), py::arg("message"), py::arg("number"),
        "Tests only: throw a C++ error of `kind` with `message` and `number`");
  m.def("_runtime_bindings", &runtimeBindings,
        "Tests only: the library each C++ runtime function of this module is bound to");
  // close() may wait for the registry's lock, held while a pool worker
  // evaluates the predicate: it releases the GIL.
  py::class_<ArmedFailpoint>(m, "_Failpoint", "Tests only: an armed failpoint")
      .def(py::init<const std::string&, int64_t, int64_t>(), py::arg("name"), py::arg("first"),
           py::arg("second") = -1)
      .def_property_readonly("fired", &ArmedFailpoint::fired)
      .def("close", &ArmedFailpoint::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace shardema::python
