// shardema._C._ChunkGate: a test hook, for tests/python only. It holds the
// chunk math of one update step at the failpoint "offload.pipeline.chunk"
// (core/include/shardema/core/failpoint.h) until Python opens it, so that a
// Python test can show what update() and wait() do while the math has not
// run, without timing anything. The hold is a C++ condition variable: no
// Python runs on the engine's threads (DESIGN.md section 8). The failpoint
// never fires: the predicate only waits, then lets the chunk through.
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "bindings.h"
#include "python_terms.h"
#include "python_warnings.h"
#include "shardema/core/failpoint.h"

namespace py = pybind11;

namespace shardema::python {
namespace {

class ChunkGate {
 public:
  // Holds every chunk of update step `step` until open(), or until one has
  // waited `timeoutSeconds` (then all go through and timedOut() says so).
  ChunkGate(int64_t step, double timeoutSeconds) : state_(std::make_shared<State>()) {
    TORCH_CHECK_VALUE(timeoutSeconds > 0, "_ChunkGate: timeout_seconds must be > 0");
    state_->step = step;
    state_->timeout = std::chrono::duration<double>(timeoutSeconds);
    std::shared_ptr<State> state = state_;
    armed_ = std::make_unique<failpoint::Armed>(
        "offload.pipeline.chunk", [state](int64_t passingStep, int64_t /*chunk*/) {
          if (passingStep != state->step) return false;
          std::unique_lock<std::mutex> lock(state->mutex);
          ++state->arrivals;
          state->changed.notify_all();
          if (!state->changed.wait_for(lock, state->timeout, [&] { return state->isOpen; })) {
            // Timed out: the test has failed; let every chunk through so it ends.
            state->timedOut = true;
            state->isOpen = true;
          }
          return false;
        });
  }
  ~ChunkGate() { close(); }

  void open() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->isOpen = true;
    state_->changed.notify_all();
  }
  // Opens, then disarms (once no chunk is at the gate).
  void close() {
    open();
    armed_.reset();
  }
  // Blocks until a chunk of the step has reached the gate, or timeoutSeconds.
  bool awaitArrival(double timeoutSeconds) {
    std::unique_lock<std::mutex> lock(state_->mutex);
    return state_->changed.wait_for(lock, std::chrono::duration<double>(timeoutSeconds),
                                    [&] { return state_->arrivals > 0; });
  }
  int64_t arrivals() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->arrivals;
  }
  bool timedOut() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->timedOut;
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    int64_t step = 0;
    std::chrono::duration<double> timeout{0};
    bool isOpen = false;
    int64_t arrivals = 0;
    bool timedOut = false;
  };
  std::shared_ptr<State> state_;
  std::unique_ptr<failpoint::Armed> armed_;
};

}  // namespace

void bindTestHooks(py::module_& m) {
  // The C++ -> Python names of messages (python_terms.h), for the test
  // that holds them to API_NAMES.md, and the rewrite itself.
  m.def("_python_terms", [] { return pythonTermsTable(); });
  m.def("_in_python_terms", [](const std::string& message) { return inPythonTerms(message); },
        py::arg("message"));
  // Every method may wait for a chunk at the gate (the failpoint registry's
  // lock is held there), so each releases the GIL.
  py::class_<ChunkGate>(m, "_ChunkGate", "Tests only: hold one update step's chunk math")
      .def(py::init<int64_t, double>(), py::arg("step"), py::arg("timeout_seconds"))
      .def("open", &ChunkGate::open, Release())
      .def("close", &ChunkGate::close, Release())
      .def("await_arrival", &ChunkGate::awaitArrival, py::arg("timeout_seconds"), Release())
      .def_property_readonly("arrivals", &ChunkGate::arrivals)
      .def_property_readonly("timed_out", &ChunkGate::timedOut);
}

}  // namespace shardema::python
