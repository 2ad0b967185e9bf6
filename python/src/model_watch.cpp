#include "model_watch.h"

#include <torch/csrc/autograd/python_variable.h>
#include <unordered_set>

#include "shardema/core/prefetch.h"

namespace shardema::python {
namespace {

// A (tuple of `arity` items) entry of list `what`, else a TypeError naming it.
PyObject* entryOf(const py::list& list, Py_ssize_t i, Py_ssize_t arity, const char* what) {
  PyObject* entry = PyList_GET_ITEM(list.ptr(), i);  // borrowed
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != arity) {
    throw py::type_error(std::string("ModelWatch: ") + what + "[" + std::to_string(i) +
                         "]: expected a tuple of " + std::to_string(arity));
  }
  return entry;
}

py::dict dictAt(PyObject* tuple, Py_ssize_t item, const char* what, Py_ssize_t i) {
  PyObject* value = PyTuple_GET_ITEM(tuple, item);
  if (!PyDict_Check(value)) {
    throw py::type_error(std::string("ModelWatch: ") + what + "[" + std::to_string(i) +
                         "]: expected a dict first");
  }
  return py::reinterpret_borrow<py::dict>(value);
}

// container[key], or nullptr when absent (no Python error left set).
PyObject* held(const py::dict& container, const py::object& key) {
  PyObject* value = PyDict_GetItemWithError(container.ptr(), key.ptr());  // borrowed
  if (value == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return value;
}

}  // namespace

DataFingerprint DataFingerprint::of(PyObject* tensor) {
  DataFingerprint out;
  if (tensor == nullptr || !THPVariable_Check(tensor)) return out;
  const at::Tensor& t = THPVariable_Unpack(tensor);
  if (!t.defined() || !t.has_storage()) return out;
  out.storage = t.storage().unsafeGetStorageImpl();
  out.offset = t.storage_offset();
  out.dtype = t.scalar_type();
  out.sizes = t.sizes().vec();
  return out;
}

bool DataFingerprint::matches(PyObject* tensor) const {
  // What of() would give, compared in place: no copy of the sizes, since
  // this runs for every tracked tensor at every update.
  if (tensor == nullptr || !THPVariable_Check(tensor)) return storage == nullptr;
  const at::Tensor& t = THPVariable_Unpack(tensor);
  if (!t.defined() || !t.has_storage()) return storage == nullptr;
  return t.storage().unsafeGetStorageImpl() == storage && t.storage_offset() == offset &&
         t.scalar_type() == dtype && t.sizes() == c10::IntArrayRef(sizes);
}

bool DataFingerprint::operator==(const DataFingerprint& other) const {
  return storage == other.storage && offset == other.offset && dtype == other.dtype &&
         sizes == other.sizes;
}

ModelWatch::ModelWatch(const py::list& slots, const py::list& edges, const py::list& counted,
                       const py::list& deciders, const py::list& frozen) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots.ptr()); ++i) {
    PyObject* entry = entryOf(slots, i, 5, "slots");
    Slot slot;
    slot.container = dictAt(entry, 0, "slots", i);
    slot.key = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 1));
    slot.tensor = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 2));
    slot.name = py::cast<std::string>(PyTuple_GET_ITEM(entry, 3));
    slot.alias = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 4)) == 1;
    slot.data = DataFingerprint::of(slot.tensor.ptr());
    slots_.push_back(std::move(slot));
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(edges.ptr()); ++i) {
    PyObject* entry = entryOf(edges, i, 3, "edges");
    edges_.push_back({dictAt(entry, 0, "edges", i),
                      py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 1)),
                      py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 2))});
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(counted.ptr()); ++i) {
    PyObject* dict = PyList_GET_ITEM(counted.ptr(), i);
    if (!PyDict_Check(dict)) {
      throw py::type_error("ModelWatch: counted[" + std::to_string(i) + "]: expected a dict");
    }
    counted_.push_back({py::reinterpret_borrow<py::dict>(dict), PyDict_Size(dict)});
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(deciders.ptr()); ++i) {
    PyObject* tensor = PyList_GET_ITEM(deciders.ptr(), i);
    if (!THPVariable_Check(tensor)) {
      throw py::type_error("ModelWatch: deciders[" + std::to_string(i) + "]: expected a tensor");
    }
    deciders_.push_back(py::reinterpret_borrow<py::object>(tensor));
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(frozen.ptr()); ++i) {
    PyObject* entry = entryOf(frozen, i, 3, "frozen");
    frozen_.push_back({dictAt(entry, 0, "frozen", i),
                       py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 1)),
                       py::cast<std::string>(PyTuple_GET_ITEM(entry, 2))});
  }
  recordPrefetch();
}

// The objects scan() and trainable() read for each tensor: with cold
// caches (a large model's EMA math or a forward pass ran since the last
// update) walking them slot by slot costs a memory latency per object,
// about 1 us per tensor on the VMs measured (bench/python_bench.py,
// return_times); issued together first, their misses overlap.
void ModelWatch::recordPrefetch() const {
  const auto addTensor = [this](PyObject* object) {
    prefetch_.add(object, 64);
    if (object == nullptr || !THPVariable_Check(object)) return;
    const at::Tensor& t = THPVariable_Unpack(object);
    if (!t.defined()) return;
    // A TensorImpl's fields read here (storage, sizes, offset, dtype,
    // autograd meta) span its first 256 bytes.
    prefetch_.add(t.unsafeGetTensorImpl(), 256);
    prefetch_.add(t.unsafeGetTensorImpl()->autograd_meta());
    if (t.has_storage()) prefetch_.add(t.storage().unsafeGetStorageImpl());
  };
  prefetch_.clear();
  prefetchStale_ = false;
  for (const Slot& slot : slots_) {
    prefetch_.add(slot.container.ptr());
    prefetch_.add(reinterpret_cast<const PyDictObject*>(slot.container.ptr())->ma_keys, 192);
    prefetch_.add(slot.key.ptr());
    prefetch_.add(slot.data.sizes.data());
    addTensor(slot.tensor.ptr());
  }
  // A decider is mostly a slot's own tensor, already recorded: its lines
  // once (a prefetch of a line in flight still takes an issue slot).
  std::unordered_set<const PyObject*> recorded;
  for (const Slot& slot : slots_) recorded.insert(slot.tensor.ptr());
  for (const py::object& tensor : deciders_) {
    if (!recorded.count(tensor.ptr())) addTensor(tensor.ptr());
  }
}

ModelWatch::Changes ModelWatch::scan() const {
  if (prefetchStale_) recordPrefetch();
  prefetch_.issue();
  Changes changes;
  for (const Edge& edge : edges_) {
    if (held(edge.children, edge.key) != edge.module.ptr()) changes.restructured = true;
  }
  for (const Counted& counted : counted_) {
    if (PyDict_Size(counted.dict.ptr()) != counted.size) changes.restructured = true;
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& slot = slots_[i];
    PyObject* now = held(slot.container, slot.key);
    const bool same = now == slot.tensor.ptr() && slot.data.matches(now);
    if (same) continue;
    // An alias (a tied weight's other key) holding something else: untied.
    if (slot.alias || now == nullptr) {
      changes.restructured = true;
    } else {
      changes.replaced.push_back(i);
    }
  }
  for (const Frozen& frozen : frozen_) {
    PyObject* now = held(frozen.container, frozen.key);
    if (now != nullptr && THPVariable_Check(now) && THPVariable_Unpack(now).requires_grad()) {
      changes.unfrozen.push_back(frozen.name);
    }
  }
  return changes;
}

std::vector<bool> ModelWatch::trainable() const {
  std::vector<bool> flags;
  flags.reserve(deciders_.size());
  for (const py::object& tensor : deciders_) {
    flags.push_back(THPVariable_Unpack(tensor.ptr()).requires_grad());
  }
  return flags;
}

void ModelWatch::refresh(size_t index) {
  Slot& slot = slots_.at(index);
  PyObject* now = held(slot.container, slot.key);
  // A replaced parameter that decided its own averaging: the new one does.
  for (py::object& decider : deciders_) {
    if (decider.ptr() == slot.tensor.ptr() && now != nullptr) {
      decider = py::reinterpret_borrow<py::object>(now);
    }
  }
  slot.tensor = py::reinterpret_borrow<py::object>(now != nullptr ? now : Py_None);
  slot.data = DataFingerprint::of(now);
  prefetchStale_ = true;  // recorded again by the next scan(), once
}

}  // namespace shardema::python
