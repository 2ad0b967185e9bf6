#pragma once
// Whether a CUDA device can be used by this process, and whether its
// absence is worth a word: a machine without a GPU (no NVIDIA driver, or a
// driver that sees no device) is simply a CPU machine, so kAuto takes the
// host engine silently; a machine whose driver is installed but fails (one
// older than our CUDA runtime, devices busy or in a bad state) probably has
// a GPU the user expected us to use, so kAuto says why not and what to do.
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
  /// No device is usable although a driver is installed and did not say
  /// "no device": a GPU is probably there but cannot be used (reason says
  /// why and what to do). false without a driver or without devices.
  bool unusableDevice = false;
};

/// The CUDA runtime's answers the probe is made of (the cudart calls'
/// results), so that what each means is testable on any machine.
struct CudaRuntimeAnswer {
  /// cudaGetDeviceCount's cudaError_t (kCudaSuccess) and count.
  int status = 0;
  int deviceCount = 0;
  /// cudaGetErrorString(status).
  std::string statusText;
  /// cudaDriverGetVersion's: 0 when no driver is installed.
  int driverVersion = 0;
  /// cudaRuntimeGetVersion's (e.g. 13000 for 13.0).
  int runtimeVersion = 0;
};

/// cudaError_t values the probe tells apart (checked against cudart's enum
/// where it is compiled in).
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorInsufficientDriver = 35;
constexpr int kCudaErrorNoDevice = 100;

/// What a runtime's answers mean (builtWithCuda set). Pure.
DeviceProbe interpretCudaRuntime(const CudaRuntimeAnswer& answer);

/// Probes the CUDA runtime on first call and caches the answer; thread-safe.
/// Logs nothing: what to tell the user is the engine choice's
/// (hostFallbackWarning).
const DeviceProbe& probeCudaDevices();

/// The one line kAuto logs when it takes the host engine for lack of a
/// usable device: empty (nothing to say) unless probe.unusableDevice.
std::string hostFallbackWarning(const DeviceProbe& probe);

}  // namespace shardema::offload
