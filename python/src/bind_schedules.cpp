// DecaySchedule in Python: one class with its three factories
// (DecaySchedule.warmup / constant / power_function), as in C++.
#include <pybind11/operators.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
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
      .def("__repr__", &DecaySchedule::describe)
      // pickle, copy and deepcopy (Lightning's ddp_spawn pickles the
      // callbacks holding one) through the JSON form, which reproduces the
      // schedule exactly. __reduce__ as well as the state pair: without it
      // protocols 0 and 1 take copyreg's path, which pybind11 aborts on;
      // with it every protocol rebuilds as protocol 2 does (__new__, then
      // __setstate__).
      .def(py::pickle([](const DecaySchedule& s) { return s.toJson(); },
                      [](const std::string& json) { return DecaySchedule::fromJson(json); }))
      .def("__reduce__",
           [](const DecaySchedule& s) {
             return py::make_tuple(py::module_::import("copyreg").attr("__newobj__"),
                                   py::make_tuple(py::type::of<DecaySchedule>()), s.toJson());
           })
      // The three factories of the C++ class, with its defaults.
      .def_static(
          "warmup",
          [](double invGamma, double power, double minValue, double maxValue,
             int64_t updateAfterStep, int64_t updateEvery) {
            WarmupScheduleOptions o;
            o.invGamma = invGamma;
            o.power = power;
            o.minValue = minValue;
            o.maxValue = maxValue;
            o.updateAfterStep = updateAfterStep;
            o.updateEvery = updateEvery;
            return DecaySchedule::warmup(o);
          },
          py::arg("inv_gamma") = WarmupScheduleOptions{}.invGamma,
          py::arg("power") = WarmupScheduleOptions{}.power,
          py::arg("min_value") = WarmupScheduleOptions{}.minValue,
          py::arg("max_value") = WarmupScheduleOptions{}.maxValue,
          py::arg("update_after_step") = WarmupScheduleOptions{}.updateAfterStep,
          py::arg("update_every") = WarmupScheduleOptions{}.updateEvery,
          "Warmup (\"inverse decay\") schedule, VersatIL's and ema-pytorch's: decay = "
          "clamp(1 - (1 + e / inv_gamma) ** -power, min_value, max_value), e = step - "
          "update_after_step - 1, and 0 while e <= 0")
      .def_static(
          "constant",
          [](double decay, int64_t updateEvery) {
            ConstantScheduleOptions o;
            o.decay = decay;
            o.updateEvery = updateEvery;
            return DecaySchedule::constant(o);
          },
          py::arg("decay"), py::arg("update_every") = ConstantScheduleOptions{}.updateEvery,
          "The same decay at every step")
      .def_static(
          "power_function",
          [](std::optional<double> sigmaRel, std::optional<double> gamma,
             const std::string& convention, int64_t updateEvery, bool stepSizeCorrection) {
            TORCH_CHECK_VALUE(sigmaRel.has_value() != gamma.has_value(),
                              "DecaySchedule.power_function: give exactly one of sigma_rel and "
                              "gamma");
            TORCH_CHECK_VALUE(!gamma || *gamma > 0,
                              "DecaySchedule.power_function: gamma must "
                              "be > 0, got ",
                              *gamma);
            PowerScheduleOptions o;
            if (sigmaRel) o.sigmaRel = *sigmaRel;
            if (gamma) o.gamma = *gamma;
            o.convention = parseConvention(convention);
            o.updateEvery = updateEvery;
            o.stepSizeCorrection = stepSizeCorrection;
            return DecaySchedule::powerFunction(o);
          },
          py::arg("sigma_rel") = py::none(), py::arg("gamma") = py::none(),
          py::arg("convention") = "nitrous",
          py::arg("update_every") = PowerScheduleOptions{}.updateEvery,
          py::arg("step_size_correction") = PowerScheduleOptions{}.stepSizeCorrection,
          "Karras et al.'s power-function EMA, given by exactly one of sigma_rel or gamma. "
          "convention: \"nitrous\" (ema-pytorch; the first update copies) or \"edm2\" (the "
          "paper's beta(n) = (1 - 1/n) ** (gamma + 1))");
}

}  // namespace shardema::python
