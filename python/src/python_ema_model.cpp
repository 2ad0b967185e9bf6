// PythonEma's side of the model it was built from (python_ema.h,
// checkModel): the ModelWatch loop, following replaced tensors through the
// lib's one rule, and requires_grad mirrored into the shards. Runs with the
// GIL held, before every update, swap and copy.
#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <utility>
#include <vector>

#include "python_ema.h"

namespace shardema::python {
namespace {

constexpr const char* kModelApi = "shardema.EMA";

// Whether `object` is a DTensor, by the public attributes shardema reads of
// one (python/shardema/_plan.py, is_dtensor).
bool isDTensor(PyObject* object) {
  for (const char* attribute : {"to_local", "placements", "device_mesh"}) {
    if (PyObject_HasAttrString(object, attribute) != 1) return false;
  }
  return true;
}

// The list `item` of the planner's tuple, else a TypeError naming it.
py::list listAt(const py::tuple& planned, size_t item, const char* what) {
  if (!py::isinstance<py::list>(planned[item])) {
    throw py::type_error(std::string(kModelApi) + " replan: " + what + " must be a list");
  }
  return planned[item].cast<py::list>();
}

// A tracked plain tensor whose module now holds a DTensor: the model was
// sharded after the EMA, whose plan (and every answer) is the plain model's.
void refuseShardedSince(PyObject* now, const std::string& name, const std::string& api) {
  TORCH_CHECK_VALUE(!isDTensor(now), api, ": '", name,
                    "' became a DTensor after the EMA was built (fully_shard or "
                    "parallelize_module applied to the model afterwards); build the EMA "
                    "after sharding the model");
}

}  // namespace

void PythonEma::checkModelForRead(const std::string& api) const {
  for (size_t index : watch_.scan().replaced) {
    const ModelWatch::Slot& slot = watch_.slots()[index];
    PyObject* now = PyDict_GetItemWithError(slot.container.ptr(), slot.key.ptr());
    if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (now != nullptr) refuseShardedSince(now, slot.name, api);
  }
}

std::vector<std::string> PythonEma::checkModel(const py::object& replan, const std::string& api) {
  std::vector<std::string> followed;
  const ModelWatch::Changes changes = watch_.scan();
  if (!changes.unfrozen.empty()) {
    std::string names;
    for (const std::string& name : changes.unfrozen) {
      names += (names.empty() ? "'" : ", '") + name + "'";
    }
    TORCH_CHECK_VALUE(false, api, ": ", names,
                      " requires grad now, but the EMA was built with trainable_only=True while "
                      "it was frozen, so it holds no EMA of it; freeze it again, or build a new "
                      "EMA (trainable_only=False keeps every parameter)");
  }
  if (changes.restructured) {
    TORCH_CHECK_VALUE(!replan.is_none(), api,
                      ": the model changed after the EMA was built (a module replaced, or a "
                      "parameter or buffer added or removed); build a new EMA");
    const py::object result = replan();
    if (!py::isinstance<py::tuple>(result) || (py::len(result) != 5 && py::len(result) != 6)) {
      throw py::type_error(api + " replan: expected a tuple of 5 or 6 lists");
    }
    const py::tuple planned = result.cast<py::tuple>();
    // followReplaced refuses before it rebinds each one; a refusal part-way
    // leaves the earlier ones followed, which is right: they were replaced.
    for (const py::handle entry : listAt(planned, 4, "followed")) {
      const auto [name, tensor] = entry.cast<std::pair<std::string, at::Tensor>>();
      if (isSource(name, tensor)) continue;  // under a new module, but the same tensor
      follow(name, tensor);
      followed.push_back(name);
    }
    std::vector<size_t> shards;
    for (const py::handle entry : listAt(planned, 3, "deciders")) {
      shards.push_back(entry.cast<py::tuple>()[1].cast<size_t>());
    }
    py::list deciders;
    for (const py::handle entry : listAt(planned, 3, "deciders")) {
      deciders.append(entry.cast<py::tuple>()[0]);
    }
    watch_ = ModelWatch(listAt(planned, 0, "slots"), listAt(planned, 1, "edges"),
                        listAt(planned, 2, "counted"), deciders,
                        py::len(planned) == 6 ? listAt(planned, 5, "frozen") : py::list());
    deciderShards_ = std::move(shards);
  } else {
    for (size_t index : changes.replaced) {
      const ModelWatch::Slot& slot = watch_.slots()[index];
      PyObject* now = PyDict_GetItemWithError(slot.container.ptr(), slot.key.ptr());
      if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
      TORCH_CHECK_VALUE(now != nullptr && now != Py_None, api, ": '", slot.name,
                        "' was removed from the model after the EMA was built; build a new EMA "
                        "for the new model");
      refuseShardedSince(now, slot.name, api);
      TORCH_CHECK_TYPE(THPVariable_Check(now), api, ": '", slot.name,
                       "' was replaced by a ", Py_TYPE(now)->tp_name, ", not a tensor");
      follow(slot.name, THPVariable_Unpack(now));
      watch_.refresh(index);
      followed.push_back(slot.name);
    }
  }
  mirrorTrainable(watch_.trainable());
  return followed;
}

// Whether `full` is the tensor the EMA reads as `name` already: the same
// storage at the same place (a module moved in the tree keeps its tensors;
// a new nn.Parameter or `p.data = ...` brings a new storage).
bool PythonEma::isSource(const std::string& name, const at::Tensor& full) const {
  const auto same = [&](const at::Tensor& source) {
    return source.defined() && full.defined() && source.has_storage() && full.has_storage() &&
           source.storage().unsafeGetStorageImpl() == full.storage().unsafeGetStorageImpl();
  };
  for (const TrackedTensor& whole : wholeTensors_) {
    if (whole.name == name) {
      return same(whole.source) && whole.source.data_ptr() == full.data_ptr() &&
             whole.source.sizes() == full.sizes();
    }
  }
  for (const LocalShard& shard : averager_->shards()) {
    if (shard.spec.name == name) return shard.local.numel() > 0 && same(shard.local);
  }
  return false;
}

void PythonEma::follow(const std::string& name, const at::Tensor& full) {
  averager_->followReplaced(name, full);  // the lib's rule: refuses before it changes anything
  for (TrackedTensor& whole : wholeTensors_) {
    if (whole.name == name) whole.source = full.detach();
  }
}

// The Averager averages a kAverageIfTrainable source while it requires
// grad and copies it otherwise; here each such source takes the flag of the
// parameter it belongs to at this update (freezing and unfreezing during
// training, VersatIL's rule). Where the flags differ, the source becomes a
// detached alias of the same elements carrying the parameter's flag: no
// copy, and nothing of the model's autograd state changes (a detached
// tensor shares the version counter, so writes stay visible).
void PythonEma::mirrorTrainable(const std::vector<bool>& trainable) {
  TORCH_CHECK(trainable.size() == deciderShards_.size(), kModelApi, ": ", trainable.size(),
              " trainable flags for ", deciderShards_.size(), " deciding parameters");
  const std::vector<LocalShard>& shards = averager_->shards();
  for (size_t k = 0; k < deciderShards_.size(); ++k) {
    const LocalShard& shard = shards[deciderShards_[k]];
    if (shard.role != TrackRole::kAverageIfTrainable) continue;
    if (shard.local.requires_grad() == trainable[k]) continue;
    at::Tensor alias = shard.local.detach();
    alias.set_requires_grad(trainable[k]);
    averager_->rebindLocal(shard.spec.name, alias);
  }
}

}  // namespace shardema::python
