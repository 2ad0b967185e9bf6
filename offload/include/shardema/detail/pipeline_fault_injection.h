#pragma once
// Test seam, for tests only: makes the math of one chunk of an
// UpdatePipeline throw, to prove that a worker's error travels to wait()
// and marks the update failed. Kept out of UpdatePipelineOptions so that no
// user sees it; a friend of UpdatePipeline sets it.
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
};

}  // namespace detail
}  // namespace shardema
