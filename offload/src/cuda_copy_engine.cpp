#include "shardema/offload/detail/cuda_copy_engine.h"

#include <c10/util/Exception.h>

#include "shardema/offload/detail/device_probe.h"

#ifdef SHARDEMA_HAVE_CUDA
#include "cuda_copy_engine_impl.h"
#include "shardema/core/warning.h"
#endif

namespace shardema::offload {

bool CudaCopyEngine::compiledIn() {
#ifdef SHARDEMA_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool CudaCopyEngine::usesTorchStream() {
#if defined(SHARDEMA_HAVE_CUDA) && defined(SHARDEMA_TORCH_CUDA)
  return true;
#else
  return false;
#endif
}

#ifdef SHARDEMA_HAVE_CUDA

CudaCopyEngine::CudaCopyEngine() {
  const DeviceProbe& probe = probeCudaDevices();
  TORCH_CHECK(probe.deviceCount > 0, "CudaCopyEngine: no usable CUDA device (", probe.reason,
              "); use EngineChoice::kAuto or kHost on this machine");
  impl_ = std::make_unique<Impl>();
}

CudaCopyEngine::~CudaCopyEngine() {
  if (!impl_) return;
  try {
    impl_->synchronize();  // stream errors went to the callbacks
  } catch (const c10::Error& e) {
    detail::warn(std::string("CudaCopyEngine: could not drain on destruction: ") +
                 e.what_without_backtrace());
  }
}

void CudaCopyEngine::recordProducerPoint() { impl_->recordProducerPoint(); }

void CudaCopyEngine::copyToHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) {
  impl_->copy(Impl::kToHost, src, dst, bytes, std::move(onDone));
}

void CudaCopyEngine::copyFromHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) {
  impl_->copy(Impl::kFromHost, src, dst, bytes, std::move(onDone));
}

void CudaCopyEngine::fenceProducer() { impl_->fenceProducer(); }

void CudaCopyEngine::synchronize() { impl_->synchronize(); }

#else  // no CUDA in this build: the type exists, constructing it says why not

struct CudaCopyEngine::Impl {};

CudaCopyEngine::CudaCopyEngine() {
  TORCH_CHECK(false,
              "CudaCopyEngine: shardema was built without CUDA (no CUDA toolkit at configure "
              "time); use EngineChoice::kAuto or kHost");
}

CudaCopyEngine::~CudaCopyEngine() = default;
void CudaCopyEngine::recordProducerPoint() {}
void CudaCopyEngine::copyToHost(const void*, void*, size_t, DoneCallback) {}
void CudaCopyEngine::copyFromHost(const void*, void*, size_t, DoneCallback) {}
void CudaCopyEngine::fenceProducer() {}
void CudaCopyEngine::synchronize() {}

#endif

}  // namespace shardema::offload
