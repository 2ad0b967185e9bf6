// Averager calls issue 23 added or changed: the 1-based step rule, fence()
// on a failed Averager, following a replaced source (rebindSource), and the
// refuseNonFinite option. Split from averager_test.cpp to keep files small.
#include <ATen/ops/equal.h>
#include <ATen/ops/eye.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "shardema/averager.h"
#include "shardema/core/tensor_file.h"

namespace shardema {
namespace {

TEST(AveragerMisuseAndRebindTest, StepZeroIsRefusedAsNotOneBased) {
  Averager averager({{"w", at::zeros({2}), TrackRole::kAverage}});
  try {
    averager.update(0);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("1-based optimizer steps; got step 0"), std::string::npos) << message;
    EXPECT_EQ(message.find("after step"), std::string::npos) << message;
  }
  EXPECT_EQ(averager.step(), 0);
  EXPECT_TRUE(averager.update(1));
}

TEST(AveragerMisuseAndRebindTest, FenceOnAFailedAveragerRaisesAndALoadRecovers) {
  at::Tensor w = at::ones({4});
  Averager averager({{"w", w, TrackRole::kAverage}});
  averager.update(1);
  averager.fence();
  const TensorFile saved = averager.state();
  averager.markFailed("a test marked it");
  try {
    averager.fence();
    FAIL() << "fence on a failed Averager must raise";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("a test marked it"), std::string::npos);
  }
  averager.loadState(saved);
  EXPECT_FALSE(averager.failed());
  averager.fence();
}

TEST(AveragerMisuseAndRebindTest, RebindFollowsAReplacementOfTheSameShapeAndRefusesAnother) {
  at::Tensor old = at::zeros({2, 2});
  ConstantScheduleOptions half;
  half.decay = 0.5;
  AveragerOptions options;
  options.schedule = DecaySchedule::constant(half);
  Averager averager({{"w", old, TrackRole::kAverage}}, options);
  averager.update(1);  // the copy: 0
  averager.fence();
  at::Tensor replacement = at::full({2, 2}, 4.0);
  averager.rebindSource("w", replacement);
  averager.update(2);
  averager.wait();
  EXPECT_TRUE(averager.ema("w").equal(at::full({2, 2}, 2.0)));  // 0.5 * 0 + 0.5 * 4
  for (const at::Tensor& other : {at::zeros({4}), at::zeros({2, 2}, at::kDouble)}) {
    try {
      averager.rebindSource("w", other);
      FAIL() << "a replacement of another shape or dtype must be refused";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("tensor 'w' was replaced by"),
                std::string::npos);
    }
  }
  at::Tensor sparse = at::eye(2).to_sparse();
  EXPECT_THROW(averager.rebindSource("w", sparse), c10::ValueError);
  EXPECT_TRUE(averager.tracked().front().source.is_same(replacement));
}

TEST(AveragerMisuseAndRebindTest, RefuseNonFiniteNamesTheTensorAndTakesNoStep) {
  at::Tensor w = at::ones({4});
  at::Tensor steps = at::zeros({1}, at::kLong);  // not floating: never checked
  AveragerOptions options;
  options.refuseNonFinite = true;
  Averager averager({{"w", w, TrackRole::kAverage}, {"steps", steps, TrackRole::kCopy}}, options);
  averager.update(1);
  averager.wait();
  w[2] = std::numeric_limits<float>::infinity();
  try {
    averager.update(2);
    FAIL() << "an Inf source must be refused";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("tensor 'w' holds NaN or Inf at step 2"),
              std::string::npos);
  }
  EXPECT_EQ(averager.step(), 1);
  EXPECT_TRUE(averager.ema("w").equal(at::ones({4})));
  w[2] = 1.0f;
  EXPECT_TRUE(averager.update(2));  // the same step, once finite again
}

}  // namespace
}  // namespace shardema
