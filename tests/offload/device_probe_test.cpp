#include "shardema/offload/detail/device_probe.h"

#include <gtest/gtest.h>

namespace shardema::offload {
namespace {

// The probe must answer (never abort) on a machine with no driver, and its
// answer must be self-consistent: a usable device has no reason attached.
TEST(DeviceProbeTest, AnswersWithoutAborting) {
  const DeviceProbe& probe = probeCudaDevices();
  EXPECT_GE(probe.deviceCount, 0);
  if (probe.deviceCount > 0) {
    EXPECT_TRUE(probe.builtWithCuda);
    EXPECT_TRUE(probe.reason.empty());
  } else {
    EXPECT_FALSE(probe.reason.empty());
  }
  EXPECT_EQ(&probe, &probeCudaDevices()) << "the probe is cached";
}

}  // namespace
}  // namespace shardema::offload
