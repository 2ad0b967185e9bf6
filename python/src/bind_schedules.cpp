// DecaySchedule in Python: one class with three factories, as in C++.
#include <pybind11/operators.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "bindings.h"
#include "conversions.h"
#include "shardema/core/decay_schedule.h"

namespace py = pybind11;

namespace shardema::python {

void bindSchedules(py::module_& m) {
  py::class_<DecaySchedule>(m, "DecaySchedule",
                            "The EMA decay as a pure function of the 1-based optimizer step")
      .def("decay_at", &DecaySchedule::decayAt, py::arg("step"),
           "Decay at 1-based step `step` (float64)")
      .def("is_due_at", &DecaySchedule::isDueAt, py::arg("step"))
      .def_property_readonly("update_every", &DecaySchedule::updateEvery)
      .def_property_readonly("gamma", &DecaySchedule::gamma)
      .def_property_readonly("sigma_rel", &DecaySchedule::sigmaRel)
      .def_property_readonly(
          "kind", [](const DecaySchedule& s) { return scheduleKindName(s.kind()); },
          "\"constant\", \"warmup\" or \"power\"")
      .def("to_json", &DecaySchedule::toJson)
      .def_static("from_json", &DecaySchedule::fromJson, py::arg("json"))
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def("__repr__", &DecaySchedule::describe);

  m.def(
      "warmup_schedule",
      [](double invGamma, double power, double minValue, double maxValue, int64_t updateAfterStep,
         int64_t updateEvery) {
        WarmupScheduleOptions o;
        o.invGamma = invGamma;
        o.power = power;
        o.minValue = minValue;
        o.maxValue = maxValue;
        o.updateAfterStep = updateAfterStep;
        o.updateEvery = updateEvery;
        return DecaySchedule::warmup(o);
      },
      py::arg("inv_gamma"), py::arg("power"), py::arg("min_value"), py::arg("max_value"),
      py::arg("update_after_step"), py::arg("update_every"));
  m.def(
      "constant_schedule",
      [](double decay, int64_t updateEvery) {
        ConstantScheduleOptions o;
        o.decay = decay;
        o.updateEvery = updateEvery;
        return DecaySchedule::constant(o);
      },
      py::arg("decay"), py::arg("update_every"));
  m.def(
      "power_schedule",
      [](double sigmaRel, double gamma, const std::string& convention, int64_t updateEvery,
         bool stepSizeCorrection) {
        PowerScheduleOptions o;
        o.sigmaRel = sigmaRel;
        o.gamma = gamma;
        o.convention = parseConvention(convention);
        o.updateEvery = updateEvery;
        o.stepSizeCorrection = stepSizeCorrection;
        return DecaySchedule::powerFunction(o);
      },
      py::arg("sigma_rel"), py::arg("gamma"), py::arg("convention"), py::arg("update_every"),
      py::arg("step_size_correction"));
}

}  // namespace shardema::python
