#pragma once
// Whether a CUDA device can be used by this process.
#include <string>

namespace shardema::offload {

/// What the CUDA runtime said about devices, asked once per process.
struct DeviceProbe {
  /// Built with the CUDA runtime (SHARDEMA_WITH_CUDA) at all.
  bool builtWithCuda = false;
  /// Number of usable devices; 0 when the runtime reports any error
  /// (no driver, insufficient driver, no device): never an abort.
  int deviceCount = 0;
  /// Why no device is usable, or empty when one is.
  std::string reason;
};

/// Probes the CUDA runtime on first call and caches the answer; thread-safe.
/// Logs one line to stderr the first time it finds no device, naming the
/// fallback (host engine).
const DeviceProbe& probeCudaDevices();

}  // namespace shardema::offload
