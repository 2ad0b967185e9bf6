#include "shardema/offload/detail/device_probe.h"

#include <string>

#ifdef SHARDEMA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardema::offload {
namespace {

#ifdef SHARDEMA_HAVE_CUDA
static_assert(kCudaSuccess == cudaSuccess);
static_assert(kCudaErrorInsufficientDriver == cudaErrorInsufficientDriver);
static_assert(kCudaErrorNoDevice == cudaErrorNoDevice);
#endif

// 13020 -> "13.2", CUDA's encoding (1000 x major + 10 x minor).
std::string cudaVersionText(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

DeviceProbe runProbe() {
  DeviceProbe probe;
#ifdef SHARDEMA_HAVE_CUDA
  CudaRuntimeAnswer answer;
  // Without a driver every runtime call fails (error 35 here); any error
  // means "no device" so a CPU-only machine keeps working on the host path.
  const cudaError_t status = cudaGetDeviceCount(&answer.deviceCount);
  answer.status = static_cast<int>(status);
  answer.statusText = cudaGetErrorString(status);
  // Both answer without a driver (the driver version is then 0).
  if (cudaDriverGetVersion(&answer.driverVersion) != cudaSuccess) answer.driverVersion = 0;
  if (cudaRuntimeGetVersion(&answer.runtimeVersion) != cudaSuccess) answer.runtimeVersion = 0;
  (void)cudaGetLastError();  // clear the sticky error for later callers
  probe = interpretCudaRuntime(answer);
#else
  probe.reason = "shardema was built without CUDA";
#endif
  return probe;
}

}  // namespace

DeviceProbe interpretCudaRuntime(const CudaRuntimeAnswer& answer) {
  DeviceProbe probe;
  probe.builtWithCuda = true;
  const std::string runtime = ", the CUDA runtime says: " + answer.statusText;
  if (answer.status == kCudaSuccess && answer.deviceCount > 0) {
    probe.deviceCount = answer.deviceCount;
  } else if (answer.status == kCudaSuccess || answer.status == kCudaErrorNoDevice) {
    probe.reason = "no CUDA device present";  // a driver without devices, or all hidden
  } else if (answer.driverVersion == 0) {
    probe.reason = "no NVIDIA driver installed" + runtime;  // a CPU machine
  } else if (answer.status == kCudaErrorInsufficientDriver) {
    probe.unusableDevice = true;
    probe.reason = "the NVIDIA driver supports CUDA up to " +
                   cudaVersionText(answer.driverVersion) + " but shardema's CUDA runtime is " +
                   cudaVersionText(answer.runtimeVersion) +
                   "; update the driver, or install shardema and torch built for CUDA " +
                   cudaVersionText(answer.driverVersion) + " or older";
  } else {
    probe.unusableDevice = true;
    probe.reason = "CUDA runtime: " + answer.statusText +
                   "; check the device with nvidia-smi (busy, exclusive-process or faulty "
                   "devices cannot be used)";
  }
  return probe;
}

const DeviceProbe& probeCudaDevices() {
  static const DeviceProbe probe = runProbe();  // C++11 magic static: thread-safe, once
  return probe;
}

std::string hostFallbackWarning(const DeviceProbe& probe) {
  if (!probe.unusableDevice) return std::string();
  return "shardema: no usable CUDA device although a driver is installed (" + probe.reason +
         "); using the host engine (choose it explicitly to silence this)";
}

}  // namespace shardema::offload
