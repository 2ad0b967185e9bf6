#include "shardema/tracking_policy.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace shardema {
namespace {

TensorTraits traits(bool isBuffer, bool isFloating, bool requiresGrad, bool inBatchNorm) {
  TensorTraits t;
  t.isBuffer = isBuffer;
  t.isFloating = isFloating;
  t.requiresGrad = requiresGrad;
  t.inBatchNorm = inBatchNorm;
  return t;
}

// Spec section 7, VersatIL: buffers copied; BatchNorm parameters copied;
// other parameters averaged while they require grad and copied while frozen
// (the seed asks requires_grad at every update, so the role defers it).
TEST(TrackingPolicyTest, VersatilAveragesOnlyTrainableNonBatchNormParameters) {
  const auto v = TrackingPolicy::kVersatil;
  EXPECT_EQ(roleFor(v, traits(false, true, true, false)), TrackRole::kAverageIfTrainable);
  EXPECT_EQ(roleFor(v, traits(false, true, false, false)), TrackRole::kAverageIfTrainable);
  EXPECT_EQ(roleFor(v, traits(false, true, true, true)), TrackRole::kCopy);
  EXPECT_EQ(roleFor(v, traits(true, true, false, true)), TrackRole::kCopy);
  EXPECT_EQ(roleFor(v, traits(true, false, false, true)), TrackRole::kCopy);
  EXPECT_EQ(roleFor(v, traits(true, true, false, false)), TrackRole::kCopy);
}

// Spec section 1, ema-pytorch: every floating tensor averaged, buffers and
// frozen ones included; integer tensors keep their initial value.
TEST(TrackingPolicyTest, EmaPytorchAveragesEveryFloatingTensor) {
  const auto e = TrackingPolicy::kEmaPytorch;
  EXPECT_EQ(roleFor(e, traits(false, true, false, false)), TrackRole::kAverage);
  EXPECT_EQ(roleFor(e, traits(false, true, true, true)), TrackRole::kAverage);
  EXPECT_EQ(roleFor(e, traits(true, true, false, true)), TrackRole::kAverage);
  EXPECT_EQ(roleFor(e, traits(true, false, false, true)), TrackRole::kCopyOnce);
}

TEST(TrackingPolicyTest, RoleNamesRoundTrip) {
  for (TrackRole role : {TrackRole::kAverage, TrackRole::kCopy, TrackRole::kCopyOnce,
                         TrackRole::kAverageIfTrainable}) {
    EXPECT_EQ(parseTrackRole(trackRoleName(role)), role);
  }
  EXPECT_THROW(parseTrackRole("mean"), c10::ValueError);
}

}  // namespace
}  // namespace shardema
