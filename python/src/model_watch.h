#pragma once
// ModelWatch: what shardema.EMA checks of the model it was built from before
// every update, swap and copy, in one C loop over Python objects with the
// GIL held (a few pointer comparisons per tensor), so that a model changed
// after the EMA was built is followed or refused by name, never averaged
// wrong in silence:
//   - each tracked tensor is still the object its module holds under its
//     key (a new nn.Parameter, a tied weight untied);
//   - its data is still the storage it was (p.data = t, module.to());
//   - each module on the way to it is still the one its parent holds (a
//     submodule replaced: model[2] = nn.Linear(...));
//   - no parameter or buffer was added to or removed from those modules;
//   - for the parameters whose requires_grad decides whether they are
//     averaged or copied, that flag now;
//   - and that no parameter left out for being frozen (trainable_only=True)
//     requires grad now: the EMA holds nothing of it, so it is refused.
// What to do about a change is the lib's rule (ShardedAverager::
// followReplaced) and, for a changed structure, the package's planner
// (python/shardema/_ema.py, EMA._replan). Holds Python references only:
// never a C++ reference to a parameter's TensorImpl, which torch's
// swap_tensors (module.to() in FSDP2 and Lightning's strategies) refuses.
#include <pybind11/pybind11.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shardema/core/prefetch.h"

namespace shardema::python {

namespace py = pybind11;

/// The storage a tensor's data lives in, to tell `p.data = t` apart.
struct DataFingerprint {
  const void* storage = nullptr;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> sizes;
  static DataFingerprint of(PyObject* tensor);
  /// Whether `tensor` has this fingerprint (of(tensor) == *this, without
  /// building one).
  bool matches(PyObject* tensor) const;
  bool operator==(const DataFingerprint& other) const;
};

class ModelWatch {
 public:
  /// One tracked tensor held by a module: container[key] is `tensor`;
  /// `name` is the EMA's name for it (a tied weight's other keys are slots
  /// of their own with alias = true: an untied one is a changed structure).
  struct Slot {
    py::dict container;
    py::object key;
    py::object tensor;
    std::string name;
    bool alias = false;
    DataFingerprint data;
  };
  /// What scan() found.
  struct Changes {
    /// Slots (indices) whose module holds another object, or whose data
    /// moved to other storage.
    std::vector<size_t> replaced;
    /// A module on a tracked path replaced, a tensor added or removed, or
    /// a tied weight untied: the planner decides.
    bool restructured = false;
    /// Names of parameters left out because frozen that require grad now.
    std::vector<std::string> unfrozen;
  };

  ModelWatch() = default;
  /// From the planner's lists (python/shardema/_ema.py): slots as
  /// (container, key, tensor, name, alias) tuples; edges as (parent's
  /// _modules dict, key, child module); counted as (a module's _parameters
  /// or _buffers dict) whose sizes are recorded now; deciders as tensors;
  /// frozen as (container, key, name): parameters left out of the EMA for
  /// being frozen, read through their slot so a replaced one is seen too.
  /// TypeError naming the list and index for a malformed entry.
  ModelWatch(const py::list& slots, const py::list& edges, const py::list& counted,
             const py::list& deciders, const py::list& frozen = py::list());

  /// The loop. GIL held.
  Changes scan() const;
  /// requires_grad of each decider, in order. GIL held.
  std::vector<bool> trainable() const;
  /// Slot `index` now holds what its container holds (after the lib
  /// followed it). GIL held.
  void refresh(size_t index);
  const std::vector<Slot>& slots() const { return slots_; }
  bool empty() const { return slots_.empty() && edges_.empty(); }

 private:
  /// Records in prefetch_ what scan() and trainable() read.
  void recordPrefetch() const;

  struct Edge {
    py::dict children;
    py::object key;
    py::object module;
  };
  struct Counted {
    py::dict dict;
    Py_ssize_t size = 0;
  };
  struct Frozen {
    py::dict container;
    py::object key;
    std::string name;
  };
  std::vector<Slot> slots_;
  // Issued at the start of scan() (core/prefetch.h); recorded again after
  // refresh() changed a slot.
  mutable core::PrefetchList prefetch_;
  mutable bool prefetchStale_ = false;
  std::vector<Edge> edges_;
  std::vector<Counted> counted_;
  std::vector<py::object> deciders_;
  std::vector<Frozen> frozen_;
};

}  // namespace shardema::python
