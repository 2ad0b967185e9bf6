#pragma once
// HostCopyEngine: the CopyEngine protocol with one copy thread and memcpy,
// for CPU training and for running the whole pipeline without a GPU.
//
// Threads: copies run in FIFO order on the engine's own thread; onDone runs
// on that thread right after its copy. A failed copy (null src or dst with
// bytes > 0) reports its c10::Error to onDone, as a failed DMA would; an
// exception thrown by onDone itself (the contract forbids it) is caught and
// warned about so the engine keeps going.
// copyToHost/copyFromHost may be called from several threads at once (the
// pipeline refills slots from its workers); fenceProducer/synchronize block
// the calling thread and must not be called from an onDone callback.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>

#include "shardema/offload/copy_engine.h"

namespace shardema {
namespace offload {

class HostCopyEngine : public CopyEngine {
 public:
  /// Starts the copy thread.
  HostCopyEngine();
  /// Drains: every queued copy and callback runs before the thread stops.
  ~HostCopyEngine() override;
  HostCopyEngine(const HostCopyEngine&) = delete;
  HostCopyEngine& operator=(const HostCopyEngine&) = delete;

  const char* name() const override { return "host"; }
  /// true: the copy thread's memcpy is the read.
  bool copiesOnHostTimeline() const override { return true; }
  /// No-op: on the host the caller's writes are done when it calls us.
  void recordProducerPoint() override {}
  void copyToHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) override;
  void copyFromHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) override;
  /// Blocks until every copy queued before the call has been done (its
  /// callback may still be running).
  void fenceProducer() override;
  /// Blocks until every copy queued before the call is done and its onDone
  /// has returned.
  void synchronize() override;

 private:
  void enqueue(const void* src, void* dst, size_t bytes, DoneCallback onDone);
  void run();
  void waitUntil(const uint64_t* counter, uint64_t target);

  std::mutex mutex_;
  std::condition_variable queued_;    // a copy was queued or stop_ set
  std::condition_variable progress_;  // copied_ or completed_ advanced
  std::deque<QueuedCopy> queue_;      // guarded by mutex_
  uint64_t submitted_ = 0;            // copies ever queued, guarded by mutex_
  uint64_t copied_ = 0;               // copies whose bytes landed, guarded by mutex_
  uint64_t completed_ = 0;            // copies whose onDone returned, guarded by mutex_
  bool stop_ = false;                 // guarded by mutex_
  std::thread thread_;                // last: starts after the state above exists
};

}  // namespace offload
}  // namespace shardema
