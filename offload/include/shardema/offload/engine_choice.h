#pragma once
// EngineChoice: which CopyEngine makeCopyEngine() builds (copy_engine.h),
// and what AveragerOptions::offload.engine selects. Its own header so that
// choosing an engine does not pull in the engine interface.

namespace shardema {
namespace offload {

enum class EngineChoice {
  /// CUDA when a device is present at run time, else host: silently on a
  /// machine without a GPU (no driver, or no device), with one warning per
  /// process where a driver is installed but no device can be used
  /// (detail/device_probe.h says why and what to do).
  kAuto,
  /// HostCopyEngine: one copy thread, memcpy. For CPU training.
  kHost,
  /// CudaCopyEngine; c10::Error when this build has no CUDA or no device is
  /// present.
  kCuda,
};

}  // namespace offload
}  // namespace shardema
