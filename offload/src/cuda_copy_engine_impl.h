#pragma once
// Internal: the CUDA side of CudaCopyEngine (only built with SHARDEMA_HAVE_CUDA).
#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "shardema/offload/detail/cuda_copy_engine.h"

namespace shardema::offload {

/// c10::Error naming the call and CUDA's message when status is an error.
void checkCuda(cudaError_t status, const char* call);

/// Owns one non-blocking stream.
class CudaStream {
 public:
  CudaStream();
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

/// Owns one event (timing disabled: used only for ordering).
class CudaEvent {
 public:
  CudaEvent();
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

/// Makes `device` current for a scope and restores the caller's device.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device);
  ~CudaDeviceScope();
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int previous_ = -1;
  int device_ = -1;
};

struct CudaCopyEngine::Impl {
  enum Direction { kToHost = 0, kFromHost = 1 };
  struct Tracker;

  // One queued callback. Claimed exactly once: by CUDA's host-callback
  // thread after the copy, or by the watchdog / synchronize() after a stream
  // error (then the host function may never run; its holder leaks a few
  // bytes, and the tracker with it).
  struct Pending {
    CopyEngine::DoneCallback onDone;
    std::atomic<bool> claimed{false};
    std::shared_ptr<Tracker> tracker;  // outlives the engine if need be
    uint64_t id = 0;
  };

  // The bookkeeping shared with the host-callback thread. Held by every
  // Pending so a late callback never touches a destroyed engine.
  struct Tracker {
    // Runs onDone unless already claimed. On the CUDA callback thread
    // (onCudaThread) its captures are handed to `graveyard` and destroyed
    // elsewhere: they may own pinned or device memory, and freeing that
    // is a CUDA call, forbidden there.
    void finish(const std::shared_ptr<Pending>& entry, std::exception_ptr error, bool onCudaThread);
    void buryDead(std::unique_lock<std::mutex>& lock);  // lock held on entry and exit

    // Guards everything below; never held across a CUDA call or onDone.
    std::mutex mutex;
    std::condition_variable changed;                       // pending, graveyard or stop changed
    std::map<uint64_t, std::shared_ptr<Pending>> pending;  // by queue order
    std::vector<CopyEngine::DoneCallback> graveyard;
    uint64_t nextId = 0;
    bool stop = false;
  };

  Impl();
  ~Impl();
  void recordProducerPoint();
  void copy(Direction direction, const void* src, void* dst, size_t bytes,
            CopyEngine::DoneCallback onDone);
  void fenceProducer();
  void synchronize();

  static void CUDART_CB hostCallback(void* data);
  cudaStream_t producerStream() const;
  // Watchdog thread: while callbacks are pending, polls the copy streams
  // and fails every pending callback on a stream error (sticky errors stop
  // host functions from ever running).
  void watch();
  void failPending(cudaError_t status, const char* call, uint64_t below);

  int device = 0;
  CudaStream streams[2];     // kToHost, kFromHost
  CudaEvent fenceEvents[2];  // recorded on streams[d] by fenceProducer
  CudaEvent producerEvent;   // recorded on the producer stream
  std::atomic<bool> producerRecorded{false};

  // Held across the CUDA calls of one copy so its wait, copy and callback
  // are queued together. Never taken by hostCallback: a CUDA call may block
  // until the device drains, which can need a host callback to run.
  std::mutex queueMutex;
  std::shared_ptr<Tracker> tracker = std::make_shared<Tracker>();
  std::thread watchdog;  // started last in the constructor, joined first
};

}  // namespace shardema::offload
