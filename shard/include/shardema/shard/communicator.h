#pragma once
// Communicator: shardema's one thin adapter over c10d. It runs the
// collectives on the group's c10d::Backend (Gloo or NCCL), makes the Gloo
// backend without Gloo's headers (shard/src/gloo_backend.h), and turns every
// failure into one c10::Error that names the operation, what it moved, this
// rank and the world size. c10d's own
// headers stay out of this one: it only forward-declares their types.
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
class ProcessGroup;
}  // namespace c10d

namespace shardema {
namespace shard {

enum class CommBackend {
  /// c10d's ProcessGroupGloo: CPU tensors, what CI runs.
  kGloo,
  /// c10d's ProcessGroupNCCL: only when LibTorch was built with CUDA
  /// (c10::Error otherwise); CPU buffers are staged through the current
  /// CUDA device.
  kNccl,
};

struct CommunicatorOptions {
  /// Bound on every blocking call (rendezvous included); a peer that is
  /// gone or out of step makes the call fail after at most this long.
  /// Default 5 minutes (DESIGN.md section 7): long enough for a slow rank to reach a
  /// checkpoint, short enough that a dead job does not hold its nodes.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  /// Which c10d backend to create. Default kGloo. Ignored when the group is
  /// handed in by the user.
  CommBackend backend = CommBackend::kGloo;
  /// Address (or host name) the Gloo transport binds to. Default "": Gloo's
  /// default device (this host name's address, loopback when it does not
  /// resolve). Tests and single-host jobs pass "127.0.0.1".
  std::string glooHostname;
};

/// A group of `worldSize` ranks. Every rank calls the same methods in the
/// same order (collective semantics); each call blocks until done or until
/// options.timeout. Tensors are contiguous CPU tensors of any dtype: data
/// moves as raw bytes (Gloo refuses bf16 broadcast), so sender and receiver
/// only need equal byte counts. After any failure the communicator is
/// broken (c10d groups are out of step after an error): later calls fail at
/// once, naming the first failure. Not thread-safe: one thread per rank.
/// Move-only.
class Communicator {
 public:
  /// Rendezvous from MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE: rank 0
  /// hosts a c10d::TCPStore, every rank joins it and creates the backend.
  /// c10::ValueError naming the variable when one is missing or invalid;
  /// c10::Error naming "rendezvous" when a rank does not join in time.
  /// Every rank, rank 0 (the store's host) included, gives up within
  /// options.timeout of the call: joining the store and the backend's
  /// rendezvous share that one deadline.
  static Communicator fromEnvironment(const CommunicatorOptions& options = {});
  /// A loopback TCP port that is free now, for MASTER_PORT of a job on one
  /// host (tests, the demo): drawn at random below the kernel's ephemeral
  /// range, where outgoing connections never take it (free_loopback_port.cpp
  /// says why). Another process may still bind it before the job does; that
  /// fails the rendezvous with an error, never a wrong group.
  static int freeLoopbackPort();

  /// Rendezvous over a store the caller made (HashStore for thread ranks,
  /// FileStore or TCPStore for process ranks). The store's timeout is set to
  /// options.timeout. Use one fresh store (or PrefixStore) per group.
  Communicator(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t worldSize,
               const CommunicatorOptions& options = {});

  /// Wraps a process group the user already has (e.g. torch.distributed's
  /// default group in an embedding). options.timeout bounds our waits; the
  /// group's own timeout still applies inside c10d.
  explicit Communicator(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                        const CommunicatorOptions& options = {});

  ~Communicator();
  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int64_t rank() const;
  int64_t worldSize() const;
  const CommunicatorOptions& options() const;
  /// True after a failed call; firstFailure() says which.
  bool broken() const;
  const std::string& firstFailure() const;

  /// Every rank passes `input` of the same byte size n; `output` (n *
  /// worldSize bytes) receives rank r's input at byte r * n. `tag` names
  /// what moves (e.g. the tensor) in error messages.
  void allGather(const at::Tensor& input, const at::Tensor& output, const std::string& tag);
  /// As allGather, but only `root` receives; `output` is ignored (may be
  /// undefined) on the other ranks.
  void gather(const at::Tensor& input, const at::Tensor& output, int64_t root,
              const std::string& tag);
  /// `root`'s bytes of `tensor` replace every other rank's (same size).
  void broadcast(const at::Tensor& tensor, int64_t root, const std::string& tag);
  /// Uneven exchange (c10d alltoall_base): rank r sends inputSplits[q] bytes
  /// (consecutive in `input`) to rank q and receives outputSplits[q] bytes
  /// from rank q into consecutive bytes of `output`. Splits are byte counts,
  /// one per rank; senders and receivers must agree.
  void allToAll(const at::Tensor& input, const at::Tensor& output,
                const std::vector<int64_t>& inputSplits, const std::vector<int64_t>& outputSplits,
                const std::string& tag);
  /// Elementwise sum over every rank, in place (c10d allreduce): what
  /// data-parallel training does to its gradients. float32 or float64, same
  /// shape on every rank; unlike the byte-moving collectives this one reads
  /// the values.
  void allReduceSum(const at::Tensor& tensor, const std::string& tag);
  /// Returns when every rank has called it.
  void barrier(const std::string& tag);

  class Impl;  // communicator.cpp: the c10d group and the failure state

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  // The store constructor with the rendezvous bounded by `deadline` (the
  // store's waits during it), so fromEnvironment's store connect and the
  // backend's rendezvous share one deadline.
  Communicator(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t worldSize,
               const CommunicatorOptions& options, std::chrono::steady_clock::time_point deadline);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shard
}  // namespace shardema
