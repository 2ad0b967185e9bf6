#pragma once
// CudaCopyEngine: the CopyEngine protocol on CUDA streams (DESIGN.md section 2).
//
// Streams: one non-blocking stream for device-to-host copies (copyToHost)
// and one for host-to-device copies (copyFromHost), created on the device
// that is current when the engine is built; copies on each run in queue
// order. The producer stream is c10's current CUDA stream when this build
// links a CUDA LibTorch (SHARDEMA_TORCH_CUDA), else the legacy default
// stream. recordProducerPoint() records an event on it and every later copy
// waits for that event on its copy stream (the host does not block);
// fenceProducer() makes the producer stream wait for the copies queued so
// far (again no host block).
//
// onDone runs on CUDA's host-callback thread (cudaLaunchHostFunc) after its
// copy; it must not call CUDA. Its captures are then destroyed on the
// engine's watchdog thread or in synchronize(), never on the callback
// thread. The FIFO order of callbacks holds per direction (each direction
// has its own stream). A copy that CUDA refuses at queue time throws
// c10::Error from copyToHost/copyFromHost (onDone is then never called).
//
// Asynchronous errors: a sticky CUDA error stops host functions from ever
// running, so the engine has a watchdog thread that, only while callbacks
// are pending, polls both copy streams with cudaStreamQuery every ~50 ms.
// Any result other than success / cudaErrorNotReady (or a failed
// cudaStreamSynchronize in synchronize()) is given as c10::Error to every
// callback queued before the poll, on the watchdog (or synchronize's)
// thread; each callback still runs exactly once. A pipeline that waits for
// every onDone therefore sees the error within ~50 ms instead of hanging.
//
// Threads: copyToHost/copyFromHost may be called from several threads at
// once; recordProducerPoint/fenceProducer/synchronize are for the producer
// thread. All CUDA errors become c10::Error naming the call and
// cudaGetErrorString. In a build without CUDA the constructor throws.
#include <memory>

#include "shardema/offload/copy_engine.h"

namespace shardema {
namespace offload {

class CudaCopyEngine : public CopyEngine {
 public:
  /// Creates the streams and events on the current device. c10::Error when
  /// the build has no CUDA or no device is usable (naming the reason).
  CudaCopyEngine();
  /// Synchronizes, then destroys streams and events.
  ~CudaCopyEngine() override;
  CudaCopyEngine(const CudaCopyEngine&) = delete;
  CudaCopyEngine& operator=(const CudaCopyEngine&) = delete;

  const char* name() const override { return "cuda"; }
  /// false: the copy streams read on the device's timeline.
  bool copiesOnHostTimeline() const override { return false; }
  void recordProducerPoint() override;
  void copyToHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) override;
  void copyFromHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) override;
  void fenceProducer() override;
  /// Blocks until both copy streams are idle and every onDone has returned.
  void synchronize() override;

  /// Whether this build has the CUDA engine at all (SHARDEMA_HAVE_CUDA).
  static bool compiledIn();
  /// Whether the producer stream is c10's current stream (SHARDEMA_TORCH_CUDA)
  /// rather than the legacy default stream.
  static bool usesTorchStream();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace offload
}  // namespace shardema
