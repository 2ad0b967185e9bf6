#pragma once
// The user's torch.distributed process group as our Communicator, so every
// collective goes through the c10d group the job already has.
#include <pybind11/pybind11.h>

#include <memory>

#include "shardema/shard/communicator.h"

namespace shardema::python {

/// `group` is a torch.distributed ProcessGroup (c10d's, as torch's own
/// Python classes hold it) or None for a job of one process, which gets a
/// Gloo group of its own over an in-memory store. timeoutSeconds bounds
/// each of our collectives. TypeError naming `process_group` for anything
/// else.
std::unique_ptr<shard::Communicator> communicatorFor(const pybind11::object& group,
                                                     double timeoutSeconds);

}  // namespace shardema::python
