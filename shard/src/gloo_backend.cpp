// Why a Python binding makes our Gloo backend: gloo_backend.h.
#include "gloo_backend.h"

// Python.h first, as the Python C API asks.
#include <Python.h>
#include <c10/util/Exception.h>
#include <link.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>  // intrusive_ptr as a pybind11 holder

#include <cstdlib>
#include <mutex>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#ifndef SHARDEMA_TORCH_PYTHON
#error "shard/CMakeLists.txt defines SHARDEMA_TORCH_PYTHON (the Python whose torch this is)"
#endif

namespace py = pybind11;

namespace shardema {
namespace shard {
namespace detail {
namespace {

constexpr const char* kApi = "Communicator (Gloo)";

// The GIL for this thread, whichever thread it is (a rank thread, a worker):
// PyGILState works for threads Python never saw, where pybind11's
// gil_scoped_acquire, shared with torch's own copy of pybind11, was seen to
// fail its thread-state check under concurrent first use.
class PythonLock {
 public:
  PythonLock() : state_(PyGILState_Ensure()) {}
  ~PythonLock() { PyGILState_Release(state_); }
  PythonLock(const PythonLock&) = delete;
  PythonLock& operator=(const PythonLock&) = delete;

 private:
  PyGILState_STATE state_;
};

// The folder this process loaded libtorch_cpu.so from ("" if none).
std::string loadedTorchLibraryDir() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const std::string path = info->dlpi_name ? info->dlpi_name : "";
        const auto slash = path.rfind('/');
        if (slash != std::string::npos &&
            path.compare(slash + 1, std::string::npos, "libtorch_cpu.so") == 0) {
          *static_cast<std::string*>(out) = path.substr(0, slash);
          return 1;
        }
        return 0;
      },
      &found);
  if (found.empty()) return found;
  char* real = realpath(found.c_str(), nullptr);
  if (real == nullptr) return found;
  std::string resolved(real);
  std::free(real);
  return resolved;
}

// A C++ program's interpreter: the build's torch Python, isolated (no
// PYTHONPATH, no user site: nothing may bring in another torch), without
// Python's signal handlers. The GIL is released at once; every use takes it.
void startInterpreter() {
  PyConfig config;
  PyConfig_InitIsolatedConfig(&config);
  PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, SHARDEMA_TORCH_PYTHON);
  if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
  PyConfig_Clear(&config);
  TORCH_CHECK(!PyStatus_Exception(status), kApi, ": could not start the Python interpreter ",
              SHARDEMA_TORCH_PYTHON, " (", status.err_msg ? status.err_msg : "no reason given",
              "); the C++ programs make c10d's Gloo backend through torch's Python binding "
              "(shard/src/gloo_backend.h)");
  PyEval_SaveThread();
}

// Refuses an interpreter whose torch is not the LibTorch this process runs:
// importing it would load a second libtorch_cpu.so under the same soname.
// Runs before the first import of torch, with the GIL held.
void checkSameTorch() {
  const std::string loaded = loadedTorchLibraryDir();
  py::object spec = py::module_::import("importlib.util").attr("find_spec")("torch");
  TORCH_CHECK(!spec.is_none(), kApi, ": ", SHARDEMA_TORCH_PYTHON,
              " has no torch; the C++ programs make c10d's Gloo backend through torch's "
              "Python binding: rerun scripts/install_deps.sh, or rebuild with the Python "
              "whose torch you link (-DPython3_EXECUTABLE)");
  const std::string origin = py::str(spec.attr("origin"));
  const std::string pythonLib =
      py::str(py::module_::import("os.path").attr("realpath")(py::module_::import("os.path").attr(
          "join")(py::module_::import("os.path").attr("dirname")(origin), "lib")));
  TORCH_CHECK(loaded.empty() || loaded == pythonLib, kApi, ": the torch of ", SHARDEMA_TORCH_PYTHON,
              " (", pythonLib, ") is not the LibTorch this program runs (", loaded,
              "); rebuild against one torch (scripts/install_deps.sh, then a fresh build)");
}

void prepareInterpreter() {
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    try {
      // In a Python process (shardema._C) torch is imported already.
      if (Py_IsInitialized()) return;
      startInterpreter();
      PythonLock lock;
      try {
        checkSameTorch();
      } catch (const py::error_already_set& e) {
        failure = e.what();
      }
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
    } catch (const std::exception& e) {
      failure = std::string(kApi) + ": starting the interpreter failed: " + e.what();
    }
  });
  TORCH_CHECK(failure.empty(), failure);
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> makeGlooBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int64_t rank, int64_t worldSize,
                                                  const std::string& hostname,
                                                  std::chrono::milliseconds timeout) {
  prepareInterpreter();
  std::string failure;
  {
    PythonLock lock;
    try {
      py::object gloo = py::module_::import("torch.distributed").attr("ProcessGroupGloo");
      py::object options = gloo.attr("_Options")();
      py::list devices;
      devices.append(hostname.empty() ? gloo.attr("create_default_device")()
                                      : gloo.attr("create_device")(py::arg("hostname") = hostname));
      options.attr("_devices") = devices;
      options.attr("_timeout") = py::module_::import("datetime")
                                     .attr("timedelta")(py::arg("milliseconds") = timeout.count());
      // The binding releases the GIL while Gloo's rendezvous waits, so the
      // other ranks of a thread-rank test reach theirs.
      py::object group = gloo(py::cast(store), rank, worldSize, options);
      return group.cast<c10::intrusive_ptr<c10d::Backend>>();
    } catch (const py::error_already_set& e) {
      failure = e.what();
    } catch (const py::cast_error& e) {
      failure = std::string("the backend did not cross from Python (") + e.what() +
                "): this build's pybind11 is not torch's";
    }
  }
  TORCH_CHECK(false, kApi, ": creating the backend for rank ", rank, " of ", worldSize,
              " failed: ", failure);
}

}  // namespace detail
}  // namespace shard
}  // namespace shardema
