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
#include "watched_tensors.h"
#include "shardema/averager_registry.h"
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

}  // namespace

void bindEma(py::module_& m) {
  // The offload pipeline's staging defaults, so shardema.EMA uses the
  // engine's instead of numbers of its own.
  m.attr("default_chunk_bytes") = offload::kDefaultChunkBytes;
  m.attr("default_num_slots") = offload::kDefaultNumSlots;
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
  m.def("fence_every_averager", &fenceEveryAverager, Release(),
        "fence() on every EMA of this process: each has read the sources of its update in "
        "flight when this returns (shardema calls it before every optimizer step)");
  m.def("replaced_watched", &replacedWatched, py::arg("watched"),
        "Positions in `watched` ((container, key, tensor, index) tuples) whose container no "
        "longer holds that tensor: what update() follows or refuses");
  py::class_<LoadReport>(m, "LoadReport", "Which names a load did not match")
      .def_readonly("missing", &LoadReport::missing, "tracked here, absent in what was loaded")
      .def_readonly("unexpected", &LoadReport::unexpected, "loaded, not tracked here")
      .def("__repr__", [](const LoadReport& r) {
        return "LoadReport(missing=" + std::string(py::str(py::cast(r.missing))) +
               ", unexpected=" + std::string(py::str(py::cast(r.unexpected))) + ")";
      });
  py::class_<PythonEma>(m, "Ema", "The engine under shardema.EMA (one rank's shards)")
      .def(py::init([](const py::object& group, double timeoutSeconds,
                       std::vector<LocalShard> shards,
                       const std::vector<std::pair<std::string, at::Tensor>>& wholeTensors,
                       const DecaySchedule& schedule, std::vector<DecaySchedule> moreSchedules,
                       bool copyOnFirstUpdate, const std::string& storage, int64_t chunkBytes,
                       int numSlots, bool fenceInUpdate, const std::string& engine,
                       std::string layoutName,
                       const std::vector<std::tuple<std::optional<at::Tensor>,
                                                    std::optional<std::string>,
                                                    std::optional<at::Tensor>>>& owners,
                       bool refuseNonFinite) {
             AveragerOptions options;
             options.schedule = schedule;
             options.moreSchedules = std::move(moreSchedules);
             options.copyOnFirstUpdate = copyOnFirstUpdate;
             options.storage = parseEmaStorage(storage);
             options.offload.chunkBytes = chunkBytes;
             options.offload.numSlots = numSlots;
             options.offload.fenceInUpdate = fenceInUpdate;
             options.offload.engine = parseEngine(engine);
             options.refuseNonFinite = refuseNonFinite;
             options.sourceWrites = SourceWrites::kAdaptive;
             std::vector<TrackedTensor> whole;
             for (const auto& [name, tensor] : wholeTensors) whole.push_back({name, tensor});
             std::vector<SourceOwner> sourceOwners;
             for (const auto& [tensor, kind, trainable] : owners) {
               SourceOwner owner;
               if (tensor) owner.tensor = *tensor;
               if (kind) owner.kind = shard::parseLayoutKind(*kind);
               if (trainable) owner.trainable = *trainable;
               sourceOwners.push_back(std::move(owner));
             }
             auto comm = communicatorFor(group, timeoutSeconds);
             PythonWarnings warnings;
             py::gil_scoped_release release;
             return std::make_unique<PythonEma>(std::move(comm), std::move(shards),
                                                std::move(whole), std::move(options),
                                                std::move(layoutName), std::move(sourceOwners));
           }),
           py::arg("process_group"), py::arg("timeout_seconds"), py::arg("shards"),
           py::arg("whole_tensors"), py::arg("schedule"), py::arg("more_schedules"),
           py::arg("copy_on_first_update"), py::arg("storage"), py::arg("chunk_bytes"),
           py::arg("num_slots"), py::arg("fence_in_update"), py::arg("engine"), py::arg("layout"),
           py::arg("owners") = std::vector<std::tuple<std::optional<at::Tensor>,
                                                      std::optional<std::string>,
                                                      std::optional<at::Tensor>>>(),
           py::arg("refuse_non_finite") = false)
      .def("update", &PythonEma::update, py::arg("step") = py::none(), Release())
      .def(
          "mirror_trainable",
          [](PythonEma& ema, const py::list& deciders) {
            std::vector<bool> flags = trainableFlags(deciders);  // reads Python objects
            py::gil_scoped_release release;
            ema.mirrorTrainable(flags);
          },
          py::arg("deciders"),
          "Follows requires_grad of each deciding parameter (the plan's owners that decide, "
          "in order) at this update")
      .def("rebind", &PythonEma::rebind, py::arg("index"), py::arg("replacement"), Release())
      .def("take_followed", &PythonEma::takeFollowed)
      .def("fence", &PythonEma::fence, Release())
      .def("wait", &PythonEma::wait, Release())
      .def_property_readonly("step", &PythonEma::step)
      .def_property_readonly("last_decay", &PythonEma::lastDecay)
      .def_property_readonly("rank", &PythonEma::rank)
      .def_property_readonly("world_size", &PythonEma::worldSize)
      .def_property_readonly("layout", &PythonEma::layout)
      .def_property_readonly("swapped", &PythonEma::swapped)
      .def("names", &PythonEma::names)
      .def("local_ema", &PythonEma::localEma, Release(),
           "This rank's EMA pieces (1-D clones, layout order)")
      .def("ema", &PythonEma::ema, py::arg("name"), py::arg("profile") = 0, Release(),
           "One tensor's EMA in local shape (a clone)")
      .def("load_full_values", &PythonEma::loadFullValues, py::arg("full"), Release())
      .def("load_local_values", &PythonEma::loadLocalValues, py::arg("local"), Release())
      .def("copy_to", &PythonEma::copyTo, Release())
      .def("swap_in", &PythonEma::swapIn, Release())
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
          [](PythonEma& e, const std::string& path, py::handle dtype) {
            const c10::ScalarType type = scalarTypeOf(dtype, "export_weights: dtype");
            PythonWarnings warnings;
            py::gil_scoped_release release;
            e.exportWeights(path, type);
          },
          py::arg("path"), py::arg("dtype"))
      .def("full_state_dict", &PythonEma::fullStateDict, py::arg("rank0_only"),
           py::arg("names") = py::none(), Release())
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
