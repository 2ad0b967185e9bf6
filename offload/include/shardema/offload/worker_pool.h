#pragma once
// WorkerPool: a fixed set of threads (Boost.Asio thread_pool) that run our
// own kernels. No user code ever runs on it. It lives in offload/ because the
// pipeline's asynchronous math is what needs background threads; core's
// kernels never see it (they run the range they are handed; see
// parallel_update.h and the pipeline).
#include <cstdint>
#include <functional>
#include <memory>

namespace shardema::offload {

class WorkerPool final {
 public:
  /// Starts numThreads workers (>= 0; c10::ValueError otherwise). With 0
  /// every job runs on the caller.
  explicit WorkerPool(int numThreads);
  /// Joins the workers; jobs still queued are finished first.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Number of worker threads (not counting callers).
  int size() const { return numThreads_; }

  /// Runs task(i) for every i in [0, numTasks) on the workers and the
  /// calling thread, and blocks until all have finished. If tasks throw, the
  /// first exception is rethrown here after all tasks ended (tasks not yet
  /// started when one throws are skipped). Thread-safe: several callers may
  /// use one pool at once, and a task may itself call parallelFor; the
  /// caller takes tasks too, so it finishes alone when every worker is busy.
  void parallelFor(int64_t numTasks, const std::function<void(int64_t)>& task);

  /// Queues fn to run on a worker and returns at once (for the async
  /// pipeline); with no workers it runs fn on the caller before returning.
  /// fn must not throw (std::terminate if it does); wrap it to capture errors.
  void post(std::function<void()> fn);

  /// A process-wide pool of sharedPoolSize() workers, created on first use.
  /// For callers that were given no pool.
  static WorkerPool& shared();

  /// The shared pool's size: SHARDEMA_THREADS when set and not empty (an integer >= 0;
  /// c10::ValueError naming the variable otherwise), else the CPUs this
  /// process may run on (its affinity mask, so numactl/taskset bindings
  /// count) divided among the ranks of this node (LOCAL_WORLD_SIZE, as
  /// torchrun sets it), minus the training thread's own, at least 1.
  static int sharedPoolSize();
  /// The rule of sharedPoolSize() over explicit inputs (for tests):
  /// `threadsVariable` SHARDEMA_THREADS's value or nullptr,
  /// `localRanksVariable` LOCAL_WORLD_SIZE's or nullptr.
  static int poolSizeFor(const char* threadsVariable, int usableCpus,
                         const char* localRanksVariable);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int numThreads_ = 0;
};

}  // namespace shardema::offload
