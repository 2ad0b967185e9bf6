#include "errors.h"

#include <c10/util/Exception.h>

#include "python_terms.h"

namespace shardema::python {

void registerErrorTranslation() {
  // Registered in our module, not left to torch's translators: those are
  // found only when both modules share pybind11's internals. Local to this
  // module: a global translator would also run first for every function of
  // torch's that shares those internals, and turned torch's own
  // torch.distributed.DistStoreError (and LinAlgError, OutOfMemoryError...)
  // into plain RuntimeError once shardema was imported
  // (tests/python/test_error_boundary.py).
  pybind11::register_local_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, inPythonTerms(e.what_without_backtrace()).c_str());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, inPythonTerms(e.what_without_backtrace()).c_str());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, inPythonTerms(e.what_without_backtrace()).c_str());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError,
                      inPythonTerms(e.what_without_backtrace()).c_str());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, inPythonTerms(e.what_without_backtrace()).c_str());
    }
  });
}

}  // namespace shardema::python
