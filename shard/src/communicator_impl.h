#pragma once
// Internal: the c10d group behind a Communicator and the one place where
// every collective is started, waited for and turned into our error.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "shardema/shard/communicator.h"

namespace shardema {
namespace shard {
namespace detail {

// Gloo and NCCL are c10d::Backends, wrapped by a ProcessGroup that
// dispatches through the op registry; we call the Backend directly: the
// same collectives, one dispatch less.
using Group = c10d::Backend;

/// Returns when this build and this process can create ProcessGroupNCCL
/// (a CUDA LibTorch and at least one visible device); c10::Error naming
/// which is missing otherwise, before any rendezvous.
void requireNccl(int64_t rank, int64_t worldSize);

/// ProcessGroupNCCL (communicator_nccl.cpp); call requireNccl first.
c10::intrusive_ptr<Group> makeNccl(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                   int64_t worldSize, const CommunicatorOptions& options);

}  // namespace detail

class Communicator::Impl {
 public:
  Impl(int64_t rankIn, int64_t worldSizeIn, CommunicatorOptions optionsIn)
      : rank(rankIn), worldSize(worldSizeIn), options(std::move(optionsIn)) {}

  std::string who() const {
    return "rank " + std::to_string(rank) + " of " + std::to_string(worldSize);
  }

  /// Fails at once when broken; otherwise starts the collective `start`
  /// returns, waits for it, and on any error marks this broken and throws
  /// a c10::Error naming `op`, `tag`, the byte count and the rank.
  template <class Start>
  void run(const char* op, const std::string& tag, int64_t bytes, Start&& start) {
    TORCH_CHECK(!broken, "Communicator::", op, " of '", tag, "' on ", who(),
                ": the communicator is broken since an earlier failure (", firstFailure,
                "); c10d groups are out of step after an error: create a new Communicator");
    std::string message;
    try {
      c10::intrusive_ptr<c10d::Work> work = start();
      // c10d's own op timeout (set in the options of every call) fires
      // first with the more precise message; this wait is the backstop,
      // a second at most later, so a collective fails within its timeout.
      work->wait(options.timeout + std::min(options.timeout / 2, std::chrono::milliseconds(1000)));
      return;
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    } catch (const std::exception& e) {
      message = e.what();
    }
    broken = true;
    firstFailure = std::string("Communicator::") + op + " of '" + tag + "' (" +
                   std::to_string(bytes) + " bytes) on " + who() + " failed: " + message;
    TORCH_CHECK(false, firstFailure);
  }

  c10::intrusive_ptr<detail::Group> group;
  c10::intrusive_ptr<c10d::Store> store;  // kept alive as long as the group
  int64_t rank;
  int64_t worldSize;
  CommunicatorOptions options;
  bool stageOnCuda = false;  // NCCL: CPU buffers go through the CUDA device
  bool broken = false;
  std::string firstFailure;
};

}  // namespace shard
}  // namespace shardema
