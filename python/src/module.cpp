// shardema._C: pybind11 over the facade. The package shardema (python/
// shardema) is its only user; see DESIGN.md section 8.
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "errors.h"

#ifndef SHARDEMA_BUILT_WITH_TORCH
#define SHARDEMA_BUILT_WITH_TORCH "unknown"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardema's C++ engine; use the package shardema, not this module";
  // The torch this module was compiled against: shardema/__init__.py
  // compares it with the torch it runs with.
  m.attr("built_with_torch") = SHARDEMA_BUILT_WITH_TORCH;
  shardema::python::registerErrorTranslation();
  shardema::python::bindSchedules(m);
  shardema::python::bindShards(m);
  shardema::python::bindEma(m);
  shardema::python::bindPostHoc(m);
  shardema::python::bindNodePlan(m);
  shardema::python::bindCommandLine(m);
  shardema::python::bindTestHooks(m);
  shardema::python::bindBoundaryProbes(m);
}
