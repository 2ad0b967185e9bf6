#include "shardema/offload/worker_pool.h"

#include <c10/util/Exception.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace shardema::offload {

struct WorkerPool::Impl {
  explicit Impl(int numThreads) : pool(static_cast<std::size_t>(numThreads)) {}
  boost::asio::thread_pool pool;
};

namespace {

// One parallelFor call. Workers and the caller claim indices from `next`, so
// whoever is free does the work: if every worker is busy (another caller, or
// a nested parallelFor on a worker) the caller simply runs all tasks itself.
// The caller only ever waits for tasks some thread has already claimed and
// is running, which is why nesting and concurrent callers cannot deadlock.
// Shared ownership because a helper may be dequeued after the call returned;
// it then finds no index left and never touches `task` (the caller's).
struct ForState {
  ForState(int64_t n, const std::function<void(int64_t)>& fn) : numTasks(n), task(&fn) {}

  const int64_t numTasks;
  const std::function<void(int64_t)>* task;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable allFinished;
  std::exception_ptr firstError;  // guarded by mutex

  // Claims and runs tasks until none are left. After a failure the remaining
  // tasks are claimed but skipped: their result would be thrown away anyway.
  void drain() {
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= numTasks) {
        return;
      }
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          (*task)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!firstError) {
            firstError = std::current_exception();
          }
          failed.store(true, std::memory_order_relaxed);
        }
      }
      // acq_rel: the last finisher must see every task's writes before it
      // wakes the caller, which then reads them.
      if (finished.fetch_add(1, std::memory_order_acq_rel) + 1 == numTasks) {
        std::lock_guard<std::mutex> lock(mutex);
        allFinished.notify_all();
      }
    }
  }

  void waitAll() {
    std::unique_lock<std::mutex> lock(mutex);
    allFinished.wait(lock, [this] { return finished.load(std::memory_order_acquire) == numTasks; });
  }
};

}  // namespace

WorkerPool::WorkerPool(int numThreads) : numThreads_(numThreads) {
  TORCH_CHECK_VALUE(numThreads >= 0, "shardema::WorkerPool: numThreads must be >= 0, got ",
                    numThreads);
  if (numThreads > 0) {
    impl_ = std::make_unique<Impl>(numThreads);
  }
}

WorkerPool::~WorkerPool() {
  if (impl_) {
    // join() (unlike the thread_pool destructor, which stops first) lets
    // queued jobs finish: post() callers rely on their jobs running.
    impl_->pool.join();
  }
}

void WorkerPool::parallelFor(int64_t numTasks, const std::function<void(int64_t)>& task) {
  if (numTasks <= 0) {
    return;
  }
  if (numTasks == 1 || numThreads_ == 0) {
    for (int64_t i = 0; i < numTasks; ++i) {
      task(i);
    }
    return;
  }
  auto state = std::make_shared<ForState>(numTasks, task);
  const int64_t helpers = std::min<int64_t>(numThreads_, numTasks - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    boost::asio::post(impl_->pool, [state] { state->drain(); });
  }
  state->drain();
  state->waitAll();
  // Taken out of the shared state under its mutex: a helper may still hold
  // `state` and drop the last reference while we rethrow; if the error were
  // still in it, that release would free the exception we are reading.
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    error = std::exchange(state->firstError, nullptr);
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

void WorkerPool::post(std::function<void()> fn) {
  if (!impl_) {
    fn();  // no workers: the documented "every job runs on the caller"
    return;
  }
  // noexcept turns a throwing job into std::terminate at the throw site
  // instead of an exception escaping a worker thread somewhere in Asio.
  boost::asio::post(impl_->pool, [fn = std::move(fn)]() noexcept { fn(); });
}

namespace {

// A whole non-negative decimal integer, or -1.
int64_t parseCount(const char* text) {
  if (text == nullptr || *text == '\0') return -1;
  int64_t value = 0;
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9' || value > 1'000'000) return -1;
    value = value * 10 + (*c - '0');
  }
  return value;
}

int usableCpuCount() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

int WorkerPool::poolSizeFor(const char* threadsVariable, int usableCpus,
                            const char* localRanksVariable) {
  if (threadsVariable != nullptr && *threadsVariable != '\0') {  // set and not empty
    const int64_t threads = parseCount(threadsVariable);
    TORCH_CHECK_VALUE(threads >= 0 && threads <= 4096, "SHARDEMA_THREADS='", threadsVariable,
                      "' is not a thread count: set a whole number from 0 (every update on "
                      "the calling thread) to 4096, or unset it for the default");
    return static_cast<int>(threads);
  }
  // A malformed LOCAL_WORLD_SIZE is the launcher's business: ignored here.
  const int64_t localRanks = std::max<int64_t>(1, parseCount(localRanksVariable));
  return std::max<int>(1, static_cast<int>(usableCpus / localRanks) - 1);
}

int WorkerPool::sharedPoolSize() {
  return poolSizeFor(std::getenv("SHARDEMA_THREADS"), usableCpuCount(),
                     std::getenv("LOCAL_WORLD_SIZE"));
}

WorkerPool& WorkerPool::shared() {
  static WorkerPool pool(sharedPoolSize());
  return pool;
}

}  // namespace shardema::offload
