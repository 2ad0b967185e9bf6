#pragma once
// HeldWorker: keeps a WorkerPool's only worker busy until release() (or its
// destruction), so a test decides what happens before the worker reads
// anything (the pipeline tests and the Averager's misuse tests).
#include <future>

#include "shardema/offload/worker_pool.h"

namespace shardema::testing {

class HeldWorker {
 public:
  explicit HeldWorker(offload::WorkerPool& pool) {
    pool.post([released = released_] { released.wait(); });
  }
  ~HeldWorker() { release(); }
  HeldWorker(const HeldWorker&) = delete;
  HeldWorker& operator=(const HeldWorker&) = delete;
  void release() {
    if (done_) return;
    done_ = true;
    release_.set_value();
  }

 private:
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
  bool done_ = false;
};

}  // namespace shardema::testing
