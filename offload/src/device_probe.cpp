#include "shardema/offload/detail/device_probe.h"

#include <string>

#ifdef SHARDEMA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "shardema/core/warning.h"

namespace shardema::offload {
namespace {

DeviceProbe runProbe() {
  DeviceProbe probe;
#ifdef SHARDEMA_HAVE_CUDA
  probe.builtWithCuda = true;
  int count = 0;
  // Without a driver every runtime call fails (error 35 here); any error
  // means "no device" so a CPU-only machine keeps working on the host path.
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count > 0) {
    probe.deviceCount = count;
  } else {
    probe.reason = status == cudaSuccess
                       ? "no CUDA device present"
                       : std::string("CUDA runtime: ") + cudaGetErrorString(status);
    (void)cudaGetLastError();  // clear the sticky error for later callers
  }
#else
  probe.reason = "shardema was built without CUDA";
#endif
  if (probe.deviceCount == 0) {
    detail::warn("shardema: no usable CUDA device (" + probe.reason + "); using the host engine");
  }
  return probe;
}

}  // namespace

const DeviceProbe& probeCudaDevices() {
  static const DeviceProbe probe = runProbe();  // C++11 magic static: thread-safe, once
  return probe;
}

}  // namespace shardema::offload
