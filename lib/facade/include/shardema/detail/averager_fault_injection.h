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
  /// Makes the next Averager built on this thread throw c10::Error while
  /// allocating the EMA storage of its tracked tensor `index`: the earlier
  /// tensors are allocated and copied by then, and with kPinnedHost the
  /// engine and the pipeline run. Once; proves that a constructor failing
  /// part-way unwinds cleanly (an allocation larger than memory does the
  /// same, without a seam, but not under AddressSanitizer).
  static void failStorageAllocation(size_t index);
  /// For the EMA stores: throws if a failure armed above is due at `index`
  /// (and disarms it).
  static void allocatingStorage(size_t index);
};

}  // namespace detail
}  // namespace shardema
