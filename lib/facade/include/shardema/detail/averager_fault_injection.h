#pragma once
// Test seam, for tests only: makes the math of one chunk of an Averager's
// pipeline throw, to prove that a worker's error marks the Averager failed
// until a saved state is loaded. Kept out of AveragerOptions so that no
// user sees it; a friend of Averager sets it.
#include "shardema/averager.h"
#include "shardema/detail/pipeline_fault_injection.h"

namespace shardema {
namespace detail {

class AveragerFaultInjection {
 public:
  /// Arms `fault` on the pipeline of a kPinnedHost Averager (c10::ValueError
  /// for kDevice, which has none). Call on the Averager's thread; it takes
  /// effect from the next update(). Does not block.
  static void inject(Averager& averager, PipelineFault fault);
};

}  // namespace detail
}  // namespace shardema
