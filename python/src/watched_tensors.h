#pragma once
// What EMA.update() reads of the Python objects before each update, in one
// pass each over lists the Python side keeps (and mutates in place when it
// follows a replaced tensor): which module entries no longer hold the tensor
// the EMA was built from, and whether each deciding parameter is trainable.
// A Python loop over 1000 tensors took about 0.5 ms once a large pass had
// evicted their objects from the caches; here it is one C loop.
// Both run with the GIL held.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace shardema::python {

/// Positions in `watched` (tuples (container dict, key, tensor, index))
/// whose container no longer holds that very tensor under its key.
std::vector<int64_t> replacedWatched(const pybind11::list& watched);

/// requires_grad of each tensor in `deciders` (parameters, DTensor ones
/// too), read from the tensor itself rather than through Python attribute
/// lookups. TypeError naming the position for an entry that is no tensor.
std::vector<bool> trainableFlags(const pybind11::list& deciders);

}  // namespace shardema::python
