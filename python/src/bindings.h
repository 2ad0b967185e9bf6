#pragma once
// The parts of shardema._C, one function per concept (module.cpp calls
// them in order). Python names are snake_case; the C++ ones stay camelCase.
#include <pybind11/pybind11.h>

namespace shardema::python {

void bindSchedules(pybind11::module_& m);  // DecaySchedule and its factories
void bindShards(pybind11::module_& m);     // roles, local shards, FSDP1 layouts
void bindEma(pybind11::module_& m);        // PythonEma
void bindPostHoc(pybind11::module_& m);    // post-hoc callback, synthesis, files
void bindNodePlan(pybind11::module_& m);   // plan_node and NodePlan: costs per node on paper
void bindCommandLine(pybind11::module_& m);  // run_command_line, version: the CLI (tools/)
void bindTestHooks(pybind11::module_& m);  // _ChunkGate, for tests/python only
void bindBoundaryProbes(pybind11::module_& m);  // _throw, _Failpoint, _runtime_bindings: tests

}  // namespace shardema::python
