#pragma once
// CopyEngine: the seam between the pipeline and the hardware.
// It moves bytes between the training side (device memory, or host memory
// for CPU training) and host staging memory, asynchronously and in order:
//   - copies are ordered after the producer's point recorded by
//     recordProducerPoint() (the training stream's current work);
//   - each copy runs after the copies queued before it on the same engine;
//   - onDone runs once the bytes have landed, on the engine's own thread
//     (CUDA host-callback thread or the host engine's copy thread). It must
//     be short, must not throw and must not call the engine: the pipeline
//     uses it to post the math to its worker pool. The engine destroys the
//     std::function (its captures) after it returns and before
//     synchronize() returns; CudaCopyEngine never does so on CUDA's
//     callback thread (captures may own pinned or device memory, whose
//     release calls CUDA), the host engine does so on its copy thread.
// Two implementations: CudaCopyEngine (streams + events, cudaMemcpyAsync)
// and HostCopyEngine (one copy thread, memcpy), which runs the same
// protocol so the whole pipeline runs and is tested without a GPU.
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "shardema/offload/engine_choice.h"

namespace shardema {
namespace offload {

class CopyEngine {
 public:
  /// Called when a copy is done; `error` is null on success, else what
  /// failed (the copy's bytes are then undefined).
  using DoneCallback = std::function<void(std::exception_ptr error)>;

  virtual ~CopyEngine() = default;
  /// "cuda" or "host", for logs and messages; never compared to choose a
  /// behaviour (the properties below say what differs).
  virtual const char* name() const = 0;
  /// Whether a copy reads its source on the host's timeline (a host thread
  /// copies it), so that a source's autograd version read after onDone
  /// tells whether an in-place write came before the read. The pipeline
  /// then checks each chunk's sources after landing (update_pipeline.h,
  /// check (b)). false for CUDA: the host thread bumps a version when it
  /// queues a kernel, long before (or after) the device writes the bytes.
  virtual bool copiesOnHostTimeline() const = 0;

  /// Records the training side's current point (CUDA: an event on the
  /// current c10 stream / the legacy default stream; host: a no-op, the
  /// caller's writes are already done). Copies queued afterwards start
  /// only after it.
  virtual void recordProducerPoint() = 0;
  /// Queues a copy of `bytes` from `src` (device or host memory) to host
  /// memory `dst` (ideally from a PinnedArena); returns at once.
  virtual void copyToHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) = 0;
  /// Queues a copy from host memory `src` to `dst` (device or host memory);
  /// returns at once. Used to swap EMA weights in for evaluation.
  virtual void copyFromHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) = 0;
  /// Makes the training side wait until every copy queued so far has read
  /// its source, so the sources may be overwritten afterwards. CUDA: the
  /// current stream waits on an event (the host does not block). Host:
  /// blocks the caller until those copies are done.
  virtual void fenceProducer() = 0;
  /// Blocks until every queued copy is done and its onDone has returned.
  virtual void synchronize() = 0;

 protected:
  /// One copy as a host-timeline engine queues it until its thread runs it.
  struct QueuedCopy {
    const void* src;
    void* dst;
    size_t bytes;
    DoneCallback onDone;
  };
};

/// A new engine of the chosen kind.
std::unique_ptr<CopyEngine> makeCopyEngine(EngineChoice choice = EngineChoice::kAuto);

}  // namespace offload
}  // namespace shardema
