// plan_node in Python: planNode with its inputs as keyword arguments (the
// C++ defaults), and the NodePlan it returns, read-only.
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdio>
#include <string>

#include "bindings.h"
#include "shardema/core/node_plan.h"

namespace py = pybind11;

namespace shardema::python {
namespace {

// Python counts parameters in floats (7e9) as often as in ints; a float
// that is a whole number is taken, anything else is the user's mistake.
int64_t wholeParameters(double parameters) {
  TORCH_CHECK_VALUE(parameters >= 1 && parameters <= 1125899906842624.0 &&
                        static_cast<double>(static_cast<int64_t>(parameters)) == parameters,
                    "plan_node: parameters (", parameters,
                    ") must be a whole number in [1, 2**50]");
  return static_cast<int64_t>(parameters);
}

// planNode's messages name the inputs as Python does already; only the
// function's own name is C++'s.
[[noreturn]] void rethrowInPythonTerms(const c10::ValueError& error, const char* cppName,
                                       const char* pythonName) {
  std::string message = error.what_without_backtrace();
  const std::string prefix = cppName;
  if (message.rfind(prefix, 0) == 0) message.replace(0, prefix.size(), pythonName);
  throw py::value_error(message);
}

std::string describe(const NodePlan& plan) {
  char text[256];
  std::snprintf(text, sizeof text,
                "NodePlan(parameters=%lld, ranks=%lld: %.3g GB over PCIe and %.3g GB through "
                "host memory per node and update, %lld cores, host RAM %.3g GiB per node, "
                "step %.3g s, EMA %.3g s)",
                static_cast<long long>(plan.inputs.parameters),
                static_cast<long long>(plan.inputs.ranks), plan.pcieBytes / 1e9,
                plan.hostMemoryBytes / 1e9, static_cast<long long>(plan.coresNeeded),
                plan.hostRamBytes / 1073741824.0, plan.stepSeconds, plan.emaSeconds);
  return text;
}

void bindInputs(py::module_& m) {
  py::class_<NodePlanInputs>(m, "NodePlanInputs", "What a NodePlan was made from")
      .def_readonly("parameters", &NodePlanInputs::parameters)
      .def_readonly("ranks", &NodePlanInputs::ranks)
      .def_readonly("gpus_per_node", &NodePlanInputs::gpusPerNode)
      .def_readonly("source_bytes", &NodePlanInputs::sourceBytes)
      .def_readonly("profiles", &NodePlanInputs::profiles)
      .def_readonly("pcie_gbps", &NodePlanInputs::pcieGbps)
      .def_readonly("host_memory_gbps", &NodePlanInputs::hostMemoryGbps)
      .def_readonly("core_gbps", &NodePlanInputs::coreGbps)
      .def_readonly("step_seconds", &NodePlanInputs::stepSeconds)
      .def_readonly("tokens_per_gpu", &NodePlanInputs::tokensPerGpu)
      .def_readonly("gpu_tflops", &NodePlanInputs::gpuTflops)
      .def_readonly("staging_bytes_per_rank", &NodePlanInputs::stagingBytesPerRank)
      .def_readonly("update_call_seconds", &NodePlanInputs::updateCallSeconds)
      .def_readonly("node_ram_gib", &NodePlanInputs::nodeRamGib);
}

void bindPlan(py::module_& m) {
  py::class_<NodePlan>(m, "NodePlan",
                       "One node's costs per update of a pinned-host EMA (shardema plan)")
      .def_readonly("inputs", &NodePlan::inputs)
      .def_readonly("ranks_per_node", &NodePlan::ranksPerNode)
      .def_readonly("elements_per_rank", &NodePlan::elementsPerRank)
      .def_readonly("elements_per_node", &NodePlan::elementsPerNode)
      .def_readonly("pcie_bytes", &NodePlan::pcieBytes)
      .def_readonly("pcie_seconds", &NodePlan::pcieSeconds)
      .def_readonly("host_memory_bytes", &NodePlan::hostMemoryBytes)
      .def_readonly("host_memory_seconds", &NodePlan::hostMemorySeconds)
      .def_readonly("kernel_bytes", &NodePlan::kernelBytes)
      .def_readonly("core_seconds", &NodePlan::coreSeconds)
      .def_readonly("cores_needed", &NodePlan::coresNeeded)
      .def_readonly("step_seconds", &NodePlan::stepSeconds)
      .def_readonly("ema_seconds", &NodePlan::emaSeconds)
      .def_readonly("overhead_seconds", &NodePlan::overheadSeconds)
      .def_readonly("host_ram_bytes", &NodePlan::hostRamBytes)
      .def_readonly("ram_fraction", &NodePlan::ramFraction)
      .def(
          "overhead_fraction",
          [](const NodePlan& plan, int64_t updateEvery) {
            try {
              return plan.overheadFraction(updateEvery);
            } catch (const c10::ValueError& error) {
              rethrowInPythonTerms(error, "NodePlan::overheadFraction",
                                   "NodePlan.overhead_fraction");
            }
          },
          py::arg("update_every") = 1,
          "The step overhead as a fraction of the step, updating every update_every steps")
      .def("__repr__", &describe);
}

}  // namespace

void bindNodePlan(py::module_& m) {
  bindInputs(m);
  bindPlan(m);
  const NodePlanInputs defaults;
  m.def(
      "plan_node",
      [](double parameters, int64_t ranks, int64_t gpusPerNode, int64_t sourceBytes,
         int64_t profiles, double pcieGbps, double hostMemoryGbps, double coreGbps,
         double stepSeconds, double tokensPerGpu, double gpuTflops, int64_t stagingBytesPerRank,
         double updateCallSeconds, double nodeRamGib) {
        NodePlanInputs in;
        in.parameters = wholeParameters(parameters);
        in.ranks = ranks;
        in.gpusPerNode = gpusPerNode;
        in.sourceBytes = sourceBytes;
        in.profiles = profiles;
        in.pcieGbps = pcieGbps;
        in.hostMemoryGbps = hostMemoryGbps;
        in.coreGbps = coreGbps;
        in.stepSeconds = stepSeconds;
        in.tokensPerGpu = tokensPerGpu;
        in.gpuTflops = gpuTflops;
        in.stagingBytesPerRank = stagingBytesPerRank;
        in.updateCallSeconds = updateCallSeconds;
        in.nodeRamGib = nodeRamGib;
        try {
          return planNode(in);
        } catch (const c10::ValueError& error) {
          rethrowInPythonTerms(error, "planNode", "plan_node");
        }
      },
      py::arg("parameters"), py::kw_only(), py::arg("ranks") = defaults.ranks,
      py::arg("gpus_per_node") = defaults.gpusPerNode,
      py::arg("source_bytes") = defaults.sourceBytes, py::arg("profiles") = defaults.profiles,
      py::arg("pcie_gbps") = defaults.pcieGbps,
      py::arg("host_memory_gbps") = defaults.hostMemoryGbps,
      py::arg("core_gbps") = defaults.coreGbps, py::arg("step_seconds") = defaults.stepSeconds,
      py::arg("tokens_per_gpu") = defaults.tokensPerGpu, py::arg("gpu_tflops") = defaults.gpuTflops,
      py::arg("staging_bytes_per_rank") = defaults.stagingBytesPerRank,
      py::arg("update_call_seconds") = defaults.updateCallSeconds,
      py::arg("node_ram_gib") = defaults.nodeRamGib,
      "What keeping the EMA in pinned host memory costs one node of an FSDP job per update, "
      "on paper (shardema plan; docs/performance.md): PCIe and host memory bytes and seconds, "
      "cores, host RAM and the step overhead");
}

}  // namespace shardema::python
