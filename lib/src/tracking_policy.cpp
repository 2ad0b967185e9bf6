#include "shardema/tracking_policy.h"

#include <c10/util/Exception.h>

namespace shardema {

TrackRole roleFor(TrackingPolicy policy, const TensorTraits& traits) {
  if (policy == TrackingPolicy::kEmaPytorch) {
    return traits.isFloating ? TrackRole::kAverage : TrackRole::kCopyOnce;
  }
  // VersatIL: statistics and frozen weights are state, not something to
  // smooth, so they follow the live model exactly.
  if (traits.isBuffer || traits.inBatchNorm || !traits.isFloating) return TrackRole::kCopy;
  return TrackRole::kAverageIfTrainable;
}

const char* trackRoleName(TrackRole role) {
  switch (role) {
    case TrackRole::kAverage:
      return "average";
    case TrackRole::kCopy:
      return "copy";
    case TrackRole::kCopyOnce:
      return "copy_once";
    case TrackRole::kAverageIfTrainable:
      return "average_if_trainable";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown TrackRole");
}

TrackRole parseTrackRole(const std::string& name) {
  for (TrackRole role : {TrackRole::kAverage, TrackRole::kCopy, TrackRole::kCopyOnce,
                         TrackRole::kAverageIfTrainable}) {
    if (name == trackRoleName(role)) return role;
  }
  TORCH_CHECK_VALUE(
      false, "parseTrackRole: expected average, copy, copy_once or average_if_trainable, got '",
      name, "'");
}

}  // namespace shardema
