#include "shardema/offload/detail/device_probe.h"

#include <gtest/gtest.h>

#include <string>

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
    EXPECT_FALSE(probe.unusableDevice);
  } else {
    EXPECT_FALSE(probe.reason.empty());
  }
  EXPECT_EQ(&probe, &probeCudaDevices()) << "the probe is cached";
}

CudaRuntimeAnswer answer(int status, const char* text, int count, int driver, int runtime) {
  CudaRuntimeAnswer a;
  a.status = status;
  a.statusText = text;
  a.deviceCount = count;
  a.driverVersion = driver;
  a.runtimeVersion = runtime;
  return a;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// What each answer of the runtime means: a machine without a GPU (no driver,
// or a driver that sees no device) is not a problem; a driver that is there
// and fails is, and the reason says what to do.
TEST(DeviceProbeTest, TellsAMachineWithoutAGpuFromAGpuThatCannotBeUsed) {
  DeviceProbe p = interpretCudaRuntime(answer(kCudaSuccess, "no error", 2, 13000, 13000));
  EXPECT_EQ(p.deviceCount, 2);
  EXPECT_TRUE(p.reason.empty());
  EXPECT_FALSE(p.unusableDevice);

  // No driver at all (this machine: libcudart without libcuda).
  p = interpretCudaRuntime(answer(kCudaErrorInsufficientDriver,
                                  "CUDA driver version is insufficient for CUDA runtime version",
                                  0, 0, 13000));
  EXPECT_EQ(p.deviceCount, 0);
  EXPECT_FALSE(p.unusableDevice);
  EXPECT_TRUE(has(p.reason, "no NVIDIA driver")) << p.reason;

  // A driver that sees no device (or CUDA_VISIBLE_DEVICES hid them all).
  p = interpretCudaRuntime(
      answer(kCudaErrorNoDevice, "no CUDA-capable device is detected", 0, 13000, 13000));
  EXPECT_FALSE(p.unusableDevice);
  EXPECT_TRUE(has(p.reason, "no CUDA device")) << p.reason;
  p = interpretCudaRuntime(answer(kCudaSuccess, "no error", 0, 13000, 13000));
  EXPECT_FALSE(p.unusableDevice);

  // A driver older than the runtime: a GPU the user expected to be used.
  p = interpretCudaRuntime(answer(kCudaErrorInsufficientDriver,
                                  "CUDA driver version is insufficient for CUDA runtime version",
                                  0, 12020, 13000));
  EXPECT_EQ(p.deviceCount, 0);
  EXPECT_TRUE(p.unusableDevice);
  EXPECT_TRUE(has(p.reason, "12.2")) << p.reason;
  EXPECT_TRUE(has(p.reason, "13.0")) << p.reason;
  EXPECT_TRUE(has(p.reason, "update the driver")) << p.reason;

  // Any other failure with a driver installed (46: devices busy).
  p = interpretCudaRuntime(
      answer(46, "all CUDA-capable devices are busy or unavailable", 0, 13000, 13000));
  EXPECT_TRUE(p.unusableDevice);
  EXPECT_TRUE(has(p.reason, "busy or unavailable")) << p.reason;
  EXPECT_TRUE(has(p.reason, "nvidia-smi")) << p.reason;
}

TEST(DeviceProbeTest, OnlyAnUnusableDeviceIsWorthAWarning) {
  const DeviceProbe noDriver = interpretCudaRuntime(
      answer(kCudaErrorInsufficientDriver, "insufficient", 0, 0, 13000));
  EXPECT_EQ(hostFallbackWarning(noDriver), "");
  const DeviceProbe noDevice =
      interpretCudaRuntime(answer(kCudaErrorNoDevice, "no device", 0, 13000, 13000));
  EXPECT_EQ(hostFallbackWarning(noDevice), "");
  const DeviceProbe oldDriver = interpretCudaRuntime(
      answer(kCudaErrorInsufficientDriver, "insufficient", 0, 12020, 13000));
  const std::string line = hostFallbackWarning(oldDriver);
  EXPECT_TRUE(has(line, "update the driver")) << line;
  EXPECT_TRUE(has(line, "host engine")) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos) << "one line";
}

}  // namespace
}  // namespace shardema::offload
