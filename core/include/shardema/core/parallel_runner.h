#pragma once
// ParallelRunner: how core's kernels spread one call over threads without
// owning any. core starts no threads; offload::WorkerPool (the Boost.Asio
// pool) implements this, and a null runner means "run on the caller".
#include <cstdint>
#include <functional>

namespace shardema {

class ParallelRunner {
 public:
  virtual ~ParallelRunner() = default;
  /// Threads that take tasks besides the caller (0: the caller alone).
  virtual int size() const = 0;
  /// Runs task(i) for every i in [0, numTasks) and returns when all have
  /// finished; the first exception a task throws is rethrown here.
  virtual void parallelFor(int64_t numTasks, const std::function<void(int64_t)>& task) = 0;
};

}  // namespace shardema
