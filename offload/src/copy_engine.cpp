#include "shardema/offload/copy_engine.h"

#include <c10/util/Exception.h>

#include <string>

#include "shardema/core/warning.h"
#include "shardema/offload/detail/cuda_copy_engine.h"
#include "shardema/offload/detail/device_probe.h"
#include "shardema/offload/detail/host_copy_engine.h"

namespace shardema::offload {
namespace {


std::unique_ptr<CopyEngine> makeCuda() {
  TORCH_CHECK(CudaCopyEngine::compiledIn(),
              "makeCopyEngine(kCuda): shardema was built without CUDA (no CUDA toolkit at "
              "configure time); use EngineChoice::kAuto or kHost");
  const DeviceProbe& probe = probeCudaDevices();
  TORCH_CHECK(probe.deviceCount > 0, "makeCopyEngine(kCuda): no usable CUDA device (", probe.reason,
              "); use EngineChoice::kAuto or kHost");
  return std::make_unique<CudaCopyEngine>();
}

// kAuto warns only where the user probably expected a GPU to be used: a
// machine without one, or one whose GPU works, is nothing to warn about.
std::unique_ptr<CopyEngine> makeAuto() {
  if (!CudaCopyEngine::compiledIn()) return std::make_unique<HostCopyEngine>();
  const DeviceProbe& probe = probeCudaDevices();
  if (probe.deviceCount == 0) {
    const std::string warning = hostFallbackWarning(probe);
    if (!warning.empty()) detail::warnOnce("makeCopyEngine(kAuto)", warning);  // once a process
    return std::make_unique<HostCopyEngine>();
  }
  try {
    return std::make_unique<CudaCopyEngine>();
  } catch (const c10::Error& e) {
    // A device that cannot give us streams should not stop training.
    detail::warn(std::string("makeCopyEngine(kAuto): the CUDA copy engine failed to start (") +
                 e.what_without_backtrace() + "); using the host engine");
    return std::make_unique<HostCopyEngine>();
  }
}

}  // namespace

std::unique_ptr<CopyEngine> makeCopyEngine(EngineChoice choice) {
  switch (choice) {
    case EngineChoice::kHost:
      return std::make_unique<HostCopyEngine>();
    case EngineChoice::kCuda:
      return makeCuda();
    case EngineChoice::kAuto:
      return makeAuto();
  }
  TORCH_CHECK_VALUE(false, "makeCopyEngine: unknown EngineChoice ", static_cast<int>(choice));
}

}  // namespace shardema::offload
