#pragma once
// Test seam, for tests only: makes the math of one chunk of an
// UpdatePipeline throw, to prove that a worker's error travels to wait()
// and marks the update failed; and mixes the direct and staged paths in one
// update without a GPU. Kept out of UpdatePipelineOptions so that no user
// sees it; a friend of UpdatePipeline sets it.
#include <cstdint>

#include "shardema/offload/update_pipeline.h"

namespace shardema {
namespace detail {

/// Which chunk of which update throws.
struct PipelineFault {
  /// Step whose update fails; -1 (default): never.
  int64_t step = -1;
  /// 0-based chunk of that update whose math throws c10::Error
  /// "injected fault" (default 0).
  int64_t chunk = 0;
};

class PipelineFaultInjection {
 public:
  /// Arms `fault` on `pipeline` (replacing an earlier one). Call on the
  /// submitting thread while no update is in flight; the next submit()
  /// hands it to the workers. Does not block.
  static void inject(offload::UpdatePipeline& pipeline, PipelineFault fault) {
    pipeline.faultStep_ = fault.step;
    pipeline.faultChunk_ = fault.chunk;
  }
  /// true: host sources of odd job indices are staged through the engine,
  /// the others read in place (unless options.stageHostSources stages them
  /// all), so one update runs both paths side by side as a device
  /// placement with some host sources would. Call between updates, on the
  /// submitting thread.
  static void mixPaths(offload::UpdatePipeline& pipeline, bool mix) { pipeline.mixPaths_ = mix; }
};

}  // namespace detail
}  // namespace shardema
