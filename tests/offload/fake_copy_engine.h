#pragma once
// A CopyEngine for the pipeline tests: one copy thread, copies in queue
// order, with knobs the real engines lack (a delay per copy, a copy that
// fails, a gate that holds every copy back). Independent of HostCopyEngine
// so the pipeline's protocol is checked against the seam's contract alone.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "shardema/offload/copy_engine.h"

namespace shardema::testing {

class FakeCopyEngine : public offload::CopyEngine {
 public:
  FakeCopyEngine() : thread_([this] { run(); }) {}
  ~FakeCopyEngine() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  const char* name() const override { return "fake"; }
  bool copiesOnHostTimeline() const override { return true; }  // its thread memcpys
  void recordProducerPoint() override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++producerPoints_;
  }
  void copyToHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) override {
    push(src, dst, bytes, std::move(onDone));
  }
  void copyFromHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) override {
    push(src, dst, bytes, std::move(onDone));
  }
  void fenceProducer() override { waitFor(ticket()); }
  void synchronize() override { waitFor(ticket()); }

  /// Sleep before each copy (simulates a slow link).
  void setDelay(std::chrono::microseconds delay) {
    std::lock_guard<std::mutex> lock(mutex_);
    delay_ = delay;
  }
  /// The copy with this 0-based index (counted over the engine's life)
  /// reports an error instead of copying; -1: none.
  void failCopy(int64_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    failAt_ = index;
  }
  int64_t copies() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  int64_t producerPoints() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return producerPoints_;
  }
  /// Largest number of copies queued and not yet done at once.
  int64_t maxQueued() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return maxQueued_;
  }

 private:

  void push(const void* src, void* dst, size_t bytes, DoneCallback onDone) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(QueuedCopy{src, dst, bytes, std::move(onDone)});
      ++queued_;
      maxQueued_ = std::max(maxQueued_, queued_ - done_);
    }
    changed_.notify_all();
  }
  int64_t ticket() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queued_;
  }
  void waitFor(int64_t ticket) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return done_ >= ticket; });
  }
  void run() {
    for (;;) {
      QueuedCopy copy;
      std::chrono::microseconds delay;
      bool fail = false;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        copy = std::move(queue_.front());
        queue_.pop_front();
        delay = delay_;
        fail = started_++ == failAt_;
      }
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      if (fail) {
        copy.onDone(std::make_exception_ptr(std::runtime_error("fake engine: copy failed")));
      } else {
        if (copy.bytes > 0) std::memcpy(copy.dst, copy.src, copy.bytes);
        copy.onDone(nullptr);
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++done_;
      }
      changed_.notify_all();
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<QueuedCopy> queue_;  // all guarded by mutex_
  int64_t queued_ = 0;
  int64_t done_ = 0;
  int64_t started_ = 0;
  int64_t failAt_ = -1;
  int64_t producerPoints_ = 0;
  int64_t maxQueued_ = 0;
  std::chrono::microseconds delay_{0};
  bool stop_ = false;
  std::thread thread_;  // last: starts after the fields above exist
};

}  // namespace shardema::testing
