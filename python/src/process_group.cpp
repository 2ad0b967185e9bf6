#include "process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>

namespace shardema::python {

std::unique_ptr<shard::Communicator> communicatorFor(const pybind11::object& group,
                                                     double timeoutSeconds) {
  TORCH_CHECK_VALUE(timeoutSeconds > 0, "shardema: timeout must be > 0 seconds, got ",
                    timeoutSeconds);
  shard::CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0));
  if (group.is_none()) {
    options.glooHostname = "127.0.0.1";
    auto store = c10::make_intrusive<c10d::HashStore>();
    return std::make_unique<shard::Communicator>(store, 0, 1, options);
  }
  c10::intrusive_ptr<c10d::ProcessGroup> processGroup;
  try {
    processGroup = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  } catch (const pybind11::cast_error&) {
    TORCH_CHECK_TYPE(false, "shardema: process_group must be a torch.distributed ProcessGroup ",
                     "(e.g. dist.new_group() or the default group), got ",
                     std::string(pybind11::str(pybind11::type::of(group))),
                     ". If it is one, shardema was built against another torch than this one: "
                     "rebuild it against the torch you run");
  }
  return std::make_unique<shard::Communicator>(processGroup, options);
}

}  // namespace shardema::python
