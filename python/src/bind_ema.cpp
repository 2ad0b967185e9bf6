// PythonEma in Python (shardema._C.Ema): shardema.EMA builds the local
// shards and holds one. A thin map: each name is the snake_case of the
// PythonEma member it calls (tests/python/test_api_names.py checks it), and
// lambdas only convert Python objects. Every call that waits, copies or
// communicates releases the GIL.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "conversions.h"
#include "dtype.h"
#include "process_group.h"
#include "python_ema.h"
#include "python_warnings.h"
#include "shardema/averager_registry.h"
#include "shardema/core/update_kernels.h"
#include "shardema/ema_callback.h"
#include "shardema/ema_substitution.h"
#include "shardema/offload/engine_choice.h"
#include "shardema/offload/update_pipeline.h"

namespace py = pybind11;

namespace shardema::python {
namespace {

RankState fromPython(const py::dict& state) {
  TORCH_CHECK_VALUE(state.contains("tensors") && state.contains("metadata"),
                    "shardema.EMA.load_state_dict: expected a dict with 'tensors' and 'metadata' "
                    "(what state_dict() returns)");
  RankState out;
  for (const auto& item : state["tensors"].cast<py::dict>()) {
    out.tensors.emplace_back(item.first.cast<std::string>(), item.second.cast<at::Tensor>());
  }
  for (const auto& item : state["metadata"].cast<py::dict>()) {
    out.metadata[item.first.cast<std::string>()] = item.second.cast<std::string>();
  }
  return out;
}

// A step argument: None, or an int (numpy's too: anything with __index__),
// never a bool or a float; TypeError naming `api`'s step otherwise.
std::optional<int64_t> stepArgument(const py::handle& step, const char* api) {
  if (step.is_none()) return std::nullopt;
  if (PyBool_Check(step.ptr()) || !PyIndex_Check(step.ptr())) {
    throw py::type_error(std::string(api) +
                         ": step must be an int (the 1-based optimizer step) or None, got " +
                         std::string(py::str(py::type::handle_of(step).attr("__name__"))) + " " +
                         std::string(py::repr(step)));
  }
  return py::cast<int64_t>(py::reinterpret_borrow<py::object>(step).attr("__index__")());
}

// One Python warning naming the tensors the EMA followed (checkModel).
void warnFollowed(const std::vector<std::string>& followed) {
  if (followed.empty()) return;
  std::string names;
  for (const std::string& name : followed) names += (names.empty() ? "'" : ", '") + name + "'";
  const std::string message =
      "shardema.EMA: " + names + (followed.size() > 1 ? " were" : " was") +
      " replaced in the model after the EMA was built (a new nn.Parameter, p.data = ..., or a "
      "module of the same shape); the EMA follows the new tensor";
  // stacklevel 2: the user's line that called into shardema.EMA.
  if (PyErr_WarnEx(PyExc_UserWarning, message.c_str(), userStackLevel()) != 0) {
    throw py::error_already_set();
  }
}

}  // namespace

void bindEma(py::module_& m) {
  // The offload pipeline's staging defaults, so shardema.EMA uses the
  // engine's instead of numbers of its own.
  m.attr("default_chunk_bytes") = offload::kDefaultChunkBytes;
  m.attr("default_num_slots") = offload::kDefaultNumSlots;
  // Profiles of one EMA (EMA(schedules=[...])), and the names a state
  // stores profile p > 0 under: the lib's one rule (averager.h).
  m.attr("max_profiles") = kMaxProfiles;
  m.def("profile_tensor_name", &profileTensorName, py::arg("name"), py::arg("profile"));
  m.def(
      "profile_of_stored_name",
      [](const std::string& stored) {
        std::string name;
        const int profile = profileOfStoredName(stored, &name);
        return std::make_pair(profile, name);
      },
      py::arg("stored"));
  // The callbacks' optimizer-step rule, the C++ callbacks' own, so that
  // shardema.callbacks has no copy of it.
  m.def("optimizer_stepped", &optimizerStepped, py::arg("batch_idx"),
        py::arg("accumulate_grad_batches"), py::arg("is_last_batch"),
        "Whether the batch ended with an optimizer step (end of an accumulation window, or the "
        "epoch's last batch)");
  // The checkpoint substitution of EmaCallback::onSaveCheckpoint, so that
  // EMACallback.on_save_checkpoint has no copy of it: the slots (a DTensor's
  // to_local()) after the substitution, the raw values it took out, the
  // float32 EMA where a slot's dtype narrowed it.
  m.def(
      "substitute_ema",
      [](NamedTensors slots, const NamedTensors& ema, const std::vector<std::string>& rawKept,
         bool adoptEma) {
        EmaSubstitution taken = substituteEma(slots, ema, rawKept, adoptEma);
        return std::make_tuple(std::move(slots), std::move(taken.raw),
                               std::move(taken.float32Ema));
      },
      py::arg("slots"), py::arg("ema"), py::arg("raw_kept") = std::vector<std::string>(),
      py::arg("adopt_ema") = false, Release(),
      "The EMA into the named slots at their dtypes: (slots, raw, float32_ema), each a list of "
      "(name, tensor)");
  m.def(
      "swapped_in_by",
      [](const at::Tensor& tensor) -> std::optional<std::string> { return swappedInBy(tensor); },
      py::arg("tensor"),
      "Who swapped EMA weights into the memory of `tensor` (None when no swap holds it)");
  m.def("fence_every_averager", &fenceEveryAverager, Release(),
        "fence() on every EMA of this process: each has read the sources of its update in "
        "flight when this returns (shardema calls it before every optimizer step)");
  py::class_<LoadReport>(m, "LoadReport", "Which names a load did not match")
      .def_readonly("missing", &LoadReport::missing, "tracked here, absent in what was loaded")
      .def_readonly("unexpected", &LoadReport::unexpected, "loaded, not tracked here")
      .def("__repr__", [](const LoadReport& r) {
        return "LoadReport(missing=" + std::string(py::str(py::cast(r.missing))) +
               ", unexpected=" + std::string(py::str(py::cast(r.unexpected))) + ")";
      });
  py::class_<PythonEmaOptions>(
      m, "EmaOptions", "shardema.EMA's options, as the engine takes them (PythonEmaOptions)")
      .def(py::init([](std::vector<DecaySchedule> schedules, bool copyOnFirstUpdate,
                       const std::string& storage, int64_t chunkBytes, int numSlots,
                       bool fenceInUpdate, const std::string& engine, bool refuseNonFinite,
                       double timeoutSeconds) {
             // One profile per schedule, profile 0 first (the Averager's
             // schedule, the others its moreSchedules).
             TORCH_CHECK_VALUE(!schedules.empty(), "shardema.EMA: schedules is empty");
             PythonEmaOptions options;
             options.averager.schedule = schedules.front();
             options.averager.moreSchedules.assign(schedules.begin() + 1, schedules.end());
             options.averager.copyOnFirstUpdate = copyOnFirstUpdate;
             options.averager.storage = parseEmaStorage(storage);
             options.averager.offload.chunkBytes = chunkBytes;
             options.averager.offload.numSlots = numSlots;
             options.averager.offload.fenceInUpdate = fenceInUpdate;
             options.averager.offload.engine = parseEngine(engine);
             options.averager.refuseNonFinite = refuseNonFinite;
             options.timeoutSeconds = timeoutSeconds;
             return options;
           }),
           py::kw_only(), py::arg("schedules"), py::arg("copy_on_first_update"), py::arg("storage"),
           py::arg("chunk_bytes"), py::arg("num_slots"), py::arg("fence_in_update"),
           py::arg("engine"), py::arg("refuse_non_finite"), py::arg("timeout_seconds"))
      .def_property_readonly("schedule",
                             [](const PythonEmaOptions& o) { return o.averager.schedule; })
      .def_property_readonly("schedules",
                             [](const PythonEmaOptions& o) {
                               std::vector<DecaySchedule> schedules{o.averager.schedule};
                               schedules.insert(schedules.end(), o.averager.moreSchedules.begin(),
                                                o.averager.moreSchedules.end());
                               return schedules;
                             })
      .def_property_readonly("timeout_seconds",
                             [](const PythonEmaOptions& o) { return o.timeoutSeconds; });
  py::class_<PythonEma>(m, "Ema", "The engine under shardema.EMA (one rank's shards)")
      .def(py::init([](const py::object& group, std::vector<LocalShard> shards,
                       const NamedTensors& wholeTensors, const PythonEmaOptions& options,
                       std::string layoutName, const py::list& slots, const py::list& edges,
                       const py::list& counted, const py::list& deciders,
                       const py::list& frozen) {
             py::list deciderTensors;
             std::vector<Decider> native;
             for (const py::handle entry : deciders) {
               const auto [tensor, shard] = entry.cast<std::pair<py::object, size_t>>();
               deciderTensors.append(tensor);
               native.push_back(Decider{shard, tensor.cast<at::Tensor>()});
             }
             ModelWatch watch(slots, edges, counted, deciderTensors, frozen);
             std::vector<TrackedTensor> whole;
             for (const auto& [name, tensor] : wholeTensors) whole.push_back({name, tensor});
             auto comm = communicatorFor(group, options.timeoutSeconds);
             PythonWarnings warnings;
             py::gil_scoped_release release;
             return std::make_unique<PythonEma>(std::move(comm), std::move(shards),
                                                std::move(whole), options,
                                                std::move(layoutName), std::move(watch), native);
           }),
           py::kw_only(), py::arg("process_group"), py::arg("shards"), py::arg("whole_tensors"),
           py::arg("options"), py::arg("layout"), py::arg("slots"), py::arg("edges"),
           py::arg("counted"), py::arg("deciders"), py::arg("frozen") = py::list())
      // One crossing per update: the model checked and followed, the flags
      // mirrored (GIL held), then the update (GIL released).
      .def(
          "update",
          [](PythonEma& e, const py::handle& step, const py::object& replan) {
            const std::optional<int64_t> native = stepArgument(step, "shardema.EMA.update");
            warnFollowed(e.checkModel(replan, "shardema.EMA.update"));
            PythonWarnings warnings;
            py::gil_scoped_release release;
            return e.update(native);
          },
          py::arg("step") = py::none(), py::arg("replan") = py::none())
      .def(
          "copy_to",
          [](PythonEma& e, const py::object& replan, int profile) {
            warnFollowed(e.checkModel(replan, "shardema.EMA.copy_to"));
            PythonWarnings warnings;
            py::gil_scoped_release release;
            e.copyTo(profile);
          },
          py::arg("replan") = py::none(), py::arg("profile") = 0)
      // Before the calls that answer for the model from what the EMA holds
      // (exports, checkpoints, state_dict, module): a model sharded since
      // would get the plain model's answer.
      .def("check_model_for_read", &PythonEma::checkModelForRead, py::arg("api"))
      .def(
          "swap_in",
          [](PythonEma& e, const py::object& replan, int profile, const std::string& api) {
            warnFollowed(e.checkModel(replan, api));
            PythonWarnings warnings;
            py::gil_scoped_release release;
            e.swapIn(profile);
          },
          py::arg("replan") = py::none(), py::arg("profile") = 0,
          py::arg("api") = "shardema.EMA.swap_in")
      .def("fence", &PythonEma::fence, Release())
      .def("wait", &PythonEma::wait, Release())
      .def_property_readonly("step", &PythonEma::step)
      .def("last_decay", &PythonEma::lastDecay, py::arg("profile") = 0)
      .def_property_readonly("num_profiles", &PythonEma::numProfiles)
      .def_property_readonly("rank", &PythonEma::rank)
      .def_property_readonly("world_size", &PythonEma::worldSize)
      .def_property_readonly("layout", &PythonEma::layout)
      .def_property_readonly("swapped", &PythonEma::swapped)
      .def("names", &PythonEma::names)
      .def("local_ema", &PythonEma::localEma, py::arg("profile") = 0, Release(),
           "This rank's EMA pieces (1-D clones, layout order)")
      .def("ema", &PythonEma::ema, py::arg("name"), py::arg("profile") = 0, Release(),
           "One tensor's EMA in local shape (a clone)")
      .def("load_full_values", &PythonEma::loadFullValues, py::arg("full"), py::arg("profile") = 0,
           Release())
      .def("load_local_values", &PythonEma::loadLocalValues, py::arg("local"),
           py::arg("profile") = 0, Release())
      .def("swap_out", &PythonEma::swapOut, Release())
      .def("state_dict",
           [](const PythonEma& e) {
             RankState state;
             {
               PythonWarnings warnings;
               py::gil_scoped_release release;
               state = e.stateDict();
             }
             return tensorsAndMetadata(state.tensors, state.metadata);
           })
      .def("state_template",
           [](const PythonEma& e) {
             RankState state = e.stateTemplate();
             return tensorsAndMetadata(state.tensors, state.metadata);
           })
      .def(
          "load_state_dict",
          [](PythonEma& e, const py::dict& state) {
            RankState native = fromPython(state);
            PythonWarnings warnings;
            py::gil_scoped_release release;
            e.loadStateDict(native);
          },
          py::arg("state"))
      .def("save_checkpoint", &PythonEma::saveCheckpoint, py::arg("folder"), Release())
      .def("load_checkpoint", &PythonEma::loadCheckpoint, py::arg("folder"), Release())
      .def(
          "export_weights",
          [](PythonEma& e, const std::string& path, py::handle dtype, py::handle maxShardSize,
             int profile,
             const std::vector<std::tuple<std::string, at::Tensor, std::string>>& untracked) {
            const c10::ScalarType type = scalarTypeOf(dtype, "shardema.EMA.export_weights: dtype");
            const std::optional<int64_t> maxShardBytes =
                byteSizeOf(maxShardSize, "shardema.EMA.export_weights: max_shard_size");
            std::vector<UntrackedTensor> model;
            for (const auto& [name, value, before] : untracked) {
              model.push_back({name, value, before});
            }
            PythonWarnings warnings;
            py::gil_scoped_release release;
            e.exportWeights(path, type, maxShardBytes, profile, model);
          },
          py::arg("path"), py::arg("dtype"), py::arg("max_shard_size") = py::none(),
          py::arg("profile") = 0,
          py::arg("untracked") = std::vector<std::tuple<std::string, at::Tensor, std::string>>())
      .def("full_state_dict", &PythonEma::fullStateDict, py::arg("rank0_only"),
           py::arg("names") = py::none(), py::arg("profile") = 0, Release())
      .def("offload_stats", [](const PythonEma& e) {
        const offload::PipelineStats stats = e.offloadStats();
        py::dict out;
        out["updates"] = stats.updates;
        out["chunks"] = stats.chunks;
        out["source_bytes"] = stats.sourceBytes;
        out["staged_bytes"] = stats.stagedBytes;
        out["staging_bytes"] = stats.stagingBytes;
        out["fence_wait_seconds"] = stats.fenceWaitSeconds;
        out["last_fence_wait_seconds"] = stats.lastFenceWaitSeconds;
        out["waiter_chunks"] = stats.waiterChunks;
        return out;
      });
}

}  // namespace shardema::python
