// PostHocCallback's constructor checks (lib/src/posthoc_options.cpp): every
// option is refused when given out of range, with a c10::ValueError naming
// the field as PostHocCallbackOptions spells it, the range and the value.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "lib/posthoc_fixture.h"
#include "shardema/core/update_kernels.h"
#include "shardema/offload/engine_choice.h"
#include "shardema/posthoc_callback.h"
#include "support/value_error.h"

namespace shardema::posthoc_test {
namespace {

PostHocCallbackOptions validOptions(const TempDir& dir) { return smallOptions(dir.path(), 4); }

TEST(PostHocOptionsTest, RejectsAnEmptyCheckpointFolder) {
  TempDir dir;
  PostHocCallbackOptions options = validOptions(dir);
  options.checkpointFolder = "";
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "checkpointFolder");
}

TEST(PostHocOptionsTest, RejectsFewerThanTwoOrDuplicateSigmaRels) {
  TempDir dir;
  PostHocCallbackOptions options = validOptions(dir);
  options.sigmaRels = {0.05};
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "sigmaRels");
  options.sigmaRels = {0.05, 0.1, 0.05};
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "sigmaRels");
}

// sigma_rel(gamma) = sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3))) falls
// from 1/sqrt(12) at gamma = 0 (a uniform average); the engine's profiles
// have gamma > 0, so (0, 1/sqrt(12)) is their range. (Over gamma > -1 the
// relation peaks at phi^(-5/2) = 0.30028 at gamma = (sqrt(5) - 3) / 2; the
// references' largest-root rule gives gamma < 0 from 0.2887 to there, and a
// complex root's real part past it: 0.5 comes out as gamma = -1.06.)
TEST(PostHocOptionsTest, RejectsSigmaRelsOutsideThePowerProfileRange) {
  TempDir dir;
  // The relation at gamma = 0, correctly rounded (1.0 / std::sqrt(12.0)
  // rounds one ulp above it).
  const double limit = std::sqrt(1.0 / ((0.0 + 2) * (0.0 + 2) * (0.0 + 3)));
  const double phiPower = std::pow((1.0 + std::sqrt(5.0)) / 2.0, -2.5);
  for (const double bad : {0.0, -0.05, limit, std::nextafter(limit, 1.0), 0.2887, phiPower, 0.5,
                           std::nan(""), std::numeric_limits<double>::infinity()}) {
    PostHocCallbackOptions options = validOptions(dir);
    options.sigmaRels = {0.05, bad};
    // The index, the exact limit (not 0.288675, which lies inside it).
    EXPECT_VALUE_ERROR(PostHocCallback{options},
                       "sigmaRels[1] must lie in (0, 1/sqrt(12) = "
                       "0.28867513459481287)");
    options.sigmaRels = {0.05, 0.1};
    options.defaultOutputSigma = bad;
    EXPECT_VALUE_ERROR(PostHocCallback{options}, "defaultOutputSigma must lie in (0, ");
  }
  PostHocCallbackOptions options = validOptions(dir);
  options.sigmaRels = {1e-6, std::nextafter(limit, 0.0)};
  options.defaultOutputSigma = std::nextafter(limit, 0.0);
  EXPECT_NO_THROW(PostHocCallback{options});
  options.sigmaRels = {0.05, 0.5};
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "got 0.5");
}

// Every field is checked when given, not at the first hook that reads it.
TEST(PostHocOptionsTest, RejectsEveryOtherFieldOutsideItsRange) {
  TempDir dir;
  const auto refused = [&](const std::function<void(PostHocCallbackOptions&)>& set,
                           const std::string& field) {
    PostHocCallbackOptions options = validOptions(dir);
    set(options);
    EXPECT_VALUE_ERROR(PostHocCallback{options}, field);
  };
  refused([](auto& o) { o.startIter = -1; }, "startIter must be >= 0, got -1");
  refused([](auto& o) { o.layout = static_cast<PostHocLayout>(7); }, "layout must be");
  refused([](auto& o) { o.storage = static_cast<EmaStorage>(7); }, "storage must be");
  refused([](auto& o) { o.policy = static_cast<TrackingPolicy>(7); }, "policy must be");
  refused([](auto& o) { o.offload.engine = static_cast<offload::EngineChoice>(7); },
          "offload.engine must be");
  refused([](auto& o) { o.offload.chunkBytes = 63; }, "offload.chunkBytes must be >= 64, got 63");
  refused([](auto& o) { o.offload.numSlots = 0; }, "offload.numSlots must be >= 1, got 0");
  refused([](auto& o) { o.outputPrefix = ""; }, "outputPrefix");
  refused([](auto& o) { o.outputPrefix = "a/b"; }, "outputPrefix");
  refused([](auto& o) { o.bufferBytes = 63; }, "bufferBytes must be >= 64, got 63");
  refused([](auto& o) { o.sigmaRels = std::vector<double>(kMaxProfiles + 1, 0.05); },
          "at most 16 profiles");
}

TEST(PostHocOptionsTest, RejectsCountsBelowOne) {
  TempDir dir;
  PostHocCallbackOptions options = validOptions(dir);
  options.checkpointEvery = 0;
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "checkpointEvery");
  options = validOptions(dir);
  options.updateEvery = 0;
  EXPECT_VALUE_ERROR(PostHocCallback{options}, "updateEvery");
}

TEST(PostHocOptionsTest, RejectsOutputDtypesOtherThanFloat32Bfloat16Float16) {
  TempDir dir;
  for (const c10::ScalarType bad : {c10::ScalarType::Double, c10::ScalarType::Long}) {
    PostHocCallbackOptions options = validOptions(dir);
    options.outputDtype = bad;
    EXPECT_VALUE_ERROR(PostHocCallback{options}, "outputDtype");
  }
}

}  // namespace
}  // namespace shardema::posthoc_test
