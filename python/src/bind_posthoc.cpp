// Post-hoc EMA in Python: the PostHocCallback lifecycle (shardema.PostHocEMA
// and callbacks.DDPPostHocEMACallback hold one), offline synthesis over a
// snapshot folder, and reading our safetensors files back. A thin map: each
// name is the snake_case of the PostHocCallback member (or free function)
// it calls.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "conversions.h"
#include "dtype.h"
#include "process_group.h"
#include "python_warnings.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/update_kernels.h"
#include "shardema/posthoc_callback.h"
#include "shardema/synthesis.h"

namespace py = pybind11;

namespace shardema::python {
namespace {

// The callback and the communicators it borrows, alive together.
struct PythonPostHoc {
  std::unique_ptr<shard::Communicator> comm;
  // HSDP: the replicas of this rank's shards (the mesh's replicate dimension).
  std::unique_ptr<shard::Communicator> replicas;
  std::unique_ptr<PostHocCallback> callback;
};

}  // namespace

void bindPostHoc(py::module_& m) {
  // The ranges the Python constructors check their arguments against, so
  // they refuse in Python terms what the C++ checks would refuse in C++'s.
  m.attr("max_sigma_rel") = kMaxSigmaRel;
  m.attr("max_profiles") = kMaxProfiles;
  py::class_<PythonPostHoc>(m, "PostHoc", "The engine under shardema.PostHocEMA")
      .def(
          py::init([](const std::vector<double>& sigmaRels, int64_t updateEvery,
                      int64_t checkpointEvery, std::string checkpointFolder, int64_t startIter,
                      double defaultOutputSigma, bool stepSizeCorrection, const std::string& layout,
                      const std::string& policy, std::string outputFolder, std::string outputPrefix,
                      py::handle outputDtype, const py::object& group, double timeoutSeconds,
                      const py::object& replicas) {
            PostHocCallbackOptions o;
            o.sigmaRels = sigmaRels;
            o.updateEvery = updateEvery;
            o.checkpointEvery = checkpointEvery;
            o.checkpointFolder = std::move(checkpointFolder);
            o.startIter = startIter;
            o.defaultOutputSigma = defaultOutputSigma;
            o.stepSizeCorrection = stepSizeCorrection;
            o.layout = parsePostHocLayout(layout);
            o.policy = parsePolicy(policy);
            o.outputFolder = std::move(outputFolder);
            o.outputPrefix = std::move(outputPrefix);
            o.outputDtype = scalarTypeOf(outputDtype, "output_dtype");
            auto holder = std::make_unique<PythonPostHoc>();
            holder->comm = communicatorFor(group, timeoutSeconds);
            PostHocRanks ranks{holder->comm->rank(), holder->comm->worldSize(), holder->comm.get()};
            if (!replicas.is_none()) {
              holder->replicas = communicatorFor(replicas, timeoutSeconds);
              ranks.replicas = holder->replicas.get();
            }
            holder->callback = std::make_unique<PostHocCallback>(std::move(o), ranks);
            return holder;
          }),
          py::arg("sigma_rels"), py::arg("update_every"), py::arg("checkpoint_every"),
          py::arg("checkpoint_folder"), py::arg("start_iter"), py::arg("default_output_sigma"),
          py::arg("step_size_correction"), py::arg("layout"), py::arg("policy"),
          py::arg("output_folder"), py::arg("output_prefix"), py::arg("output_dtype"),
          py::arg("process_group"), py::arg("timeout_seconds"), py::arg("replicas") = py::none())
      .def(
          "on_fit_start",
          [](PythonPostHoc& p, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
             const std::vector<std::string>& roles, const std::vector<bool>& changesInForward) {
            TORCH_CHECK_VALUE(
                roles.size() == tensors.size() && changesInForward.size() == tensors.size(),
                "on_fit_start: one role and one changes_in_forward per tensor");
            std::vector<TrackedTensor> tracked;
            for (size_t i = 0; i < tensors.size(); ++i) {
              tracked.push_back({tensors[i].first, tensors[i].second, parseTrackRole(roles[i]),
                                 changesInForward[i]});
            }
            PythonWarnings warnings;
            py::gil_scoped_release release;
            p.callback->onFitStart(std::move(tracked));
          },
          py::arg("tensors"), py::arg("roles"), py::arg("changes_in_forward"))
      .def(
          "on_fit_start",
          [](PythonPostHoc& p, std::vector<LocalShard> shards,
             const std::vector<std::pair<std::string, at::Tensor>>& wholeReplicated) {
            // Only the name and the tensor matter to the validation swap.
            std::vector<TrackedTensor> whole;
            for (const auto& [name, tensor] : wholeReplicated) {
              whole.push_back({name, tensor, TrackRole::kAverage, false});
            }
            PythonWarnings warnings;
            py::gil_scoped_release release;
            p.callback->onFitStart(std::move(shards), std::move(whole));
          },
          py::arg("shards"),
          py::arg("whole_replicated") = std::vector<std::pair<std::string, at::Tensor>>{})
      .def(
          "on_train_batch_end",
          [](PythonPostHoc& p, int64_t globalStep, int64_t batchIdx, int64_t accumulate,
             bool isLastBatch) {
            return p.callback->onTrainBatchEnd(globalStep, batchIdx, accumulate, isLastBatch);
          },
          py::arg("global_step"), py::arg("batch_idx"), py::arg("accumulate_grad_batches"),
          py::arg("is_last_batch"), Release())
      .def(
          "on_before_optimizer_step", [](PythonPostHoc& p) { p.callback->onBeforeOptimizerStep(); },
          Release())
      .def(
          "wait", [](PythonPostHoc& p) { p.callback->wait(); }, Release())
      .def("on_save_checkpoint",
           [](PythonPostHoc& p) {
             // Between snapshot calls it waits for the math and writes the
             // resume state: without the GIL.
             TrainingCheckpoint checkpoint;
             {
               PythonWarnings warnings;
               py::gil_scoped_release release;
               p.callback->onSaveCheckpoint(checkpoint);
             }
             return checkpoint.metadata;
           })
      .def(
          "on_load_checkpoint",
          [](PythonPostHoc& p, std::map<std::string, std::string> metadata) {
            TrainingCheckpoint checkpoint;
            checkpoint.metadata = std::move(metadata);
            PythonWarnings warnings;
            py::gil_scoped_release release;
            p.callback->onLoadCheckpoint(checkpoint);
          },
          py::arg("metadata"))
      .def(
          "on_validation_start", [](PythonPostHoc& p) { return p.callback->onValidationStart(); },
          Release())
      .def(
          "on_validation_end", [](PythonPostHoc& p) { p.callback->onValidationEnd(); }, Release())
      .def(
          "on_train_end", [](PythonPostHoc& p) { return p.callback->onTrainEnd(); }, Release())
      .def_property_readonly("calls", [](const PythonPostHoc& p) { return p.callback->calls(); })
      .def_property_readonly("rank", [](const PythonPostHoc& p) { return p.comm->rank(); })
      .def_property_readonly("world_size",
                             [](const PythonPostHoc& p) { return p.comm->worldSize(); })
      .def_property_readonly("holds_ema",
                             [](const PythonPostHoc& p) { return p.callback->holdsEma(); })
      .def_property_readonly("snapshot_folder",
                             [](const PythonPostHoc& p) { return p.callback->snapshotFolder(); })
      .def_property_readonly("ema_swapped_in",
                             [](const PythonPostHoc& p) { return p.callback->emaSwappedIn(); });

  m.def(
      "synthesize_snapshot_folder",
      [](const std::string& folder, const std::string& path, double sigmaRel, int64_t step,
         bool normalize, py::handle dtype, int64_t bufferBytes) {
        SnapshotSynthesisOptions o;
        o.sigmaRel = sigmaRel;
        o.step = step;
        o.normalize = normalize;
        o.outputDtype = scalarTypeOf(dtype, "dtype");
        o.bufferBytes = bufferBytes;
        FolderSynthesisReport report;
        {
          PythonWarnings warnings;
          py::gil_scoped_release release;
          report = synthesizeSnapshotFolder(folder, path, o);
        }
        py::dict out;
        out["files"] = report.files;
        out["weights"] = report.weights.weights;
        out["sharded"] = report.sharded;
        out["world_size"] = report.worldSize;
        out["tensors"] = report.tensors;
        return out;
      },
      py::arg("folder"), py::arg("path"), py::arg("sigma_rel"), py::arg("step"),
      py::arg("normalize"), py::arg("dtype"), py::arg("buffer_bytes"));

  m.def(
      "read_tensor_file",
      [](const std::string& path) {
        TensorFile file;
        {
          PythonWarnings warnings;
          py::gil_scoped_release release;
          file = readTensorFile(path);
        }
        return tensorsAndMetadata(file.tensors, file.metadata);
      },
      py::arg("path"), "A safetensors file we wrote, validated (sizes, checksums)");
}

}  // namespace shardema::python
