#pragma once
// PipelineStats: what one UpdatePipeline has done so far, for logs and
// benchmarks (Averager::offloadStats() returns it). A plain value: a copy
// taken under the pipeline's lock, so it may be read on any thread.
#include <cstdint>

namespace shardema {
namespace offload {

struct PipelineStats {
  /// submit() calls that had at least one chunk to copy.
  int64_t updates = 0;
  /// Chunks, staged or direct, all updates.
  int64_t chunks = 0;
  /// Source bytes read (the bytes a user's model has), all updates.
  int64_t sourceBytes = 0;
  /// Of sourceBytes, those copied into staging by the engine (the rest
  /// were read in place: the direct path).
  int64_t stagedBytes = 0;
  /// Seconds fence() blocked, all updates: time the training loop waited
  /// for the EMA instead of overlapping with it.
  double fenceWaitSeconds = 0.0;
  /// Direct chunks the thread blocked in fence() or wait() took on because
  /// no worker had started them (counted whether their math ran or was
  /// skipped after a failure): the part of the EMA that was not hidden
  /// behind the training step (0 when the step is longer than the update).
  int64_t waiterChunks = 0;
  /// Worker tasks the staged chunks' math ran as: a landed chunk is cut
  /// into as many parts as there are workers per staging slot (at least
  /// 32Ki elements each), so this exceeds the staged chunks when workers
  /// would otherwise sit idle.
  int64_t stagedParts = 0;
  /// Seconds the last fence() blocked.
  double lastFenceWaitSeconds = 0.0;
  /// Staging memory held now: 0 until a staged chunk needs a slot (always
  /// 0 for sources in host memory), then what the largest update's staged
  /// chunks needed, each slot rounded up to a page, never more than
  /// numSlots x chunkBytes (update_pipeline.h, "Staging memory").
  int64_t stagingBytes = 0;
};

}  // namespace offload
}  // namespace shardema
