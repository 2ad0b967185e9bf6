// The CUDA side of CudaCopyEngine; see cuda_copy_engine.h for the protocol.
#ifdef SHARDEMA_HAVE_CUDA
#include "cuda_copy_engine_impl.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <vector>

#include "shardema/core/warning.h"

#ifdef SHARDEMA_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace shardema::offload {

void checkCuda(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error for the next caller
  TORCH_CHECK(false, "CudaCopyEngine: ", call, " failed: ", cudaGetErrorString(status), " (",
              static_cast<int>(status), ")");
}

CudaStream::CudaStream() {
  checkCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags");
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

CudaEvent::CudaEvent() {
  checkCuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

CudaDeviceScope::CudaDeviceScope(int device) : device_(device) {
  checkCuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device_) checkCuda(cudaSetDevice(device_), "cudaSetDevice");
}

CudaDeviceScope::~CudaDeviceScope() {
  if (previous_ != device_ && previous_ >= 0) (void)cudaSetDevice(previous_);
}

namespace {

int currentDevice() {
  int device = 0;
  checkCuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

}  // namespace

// How often the watchdog polls the copy streams while callbacks are pending:
// the delay before a sticky error reaches the callbacks.
constexpr std::chrono::milliseconds kWatchdogPeriod{50};

// Members are built on the device current now (the training device).
CudaCopyEngine::Impl::Impl() : device(currentDevice()) {
  watchdog = std::thread([this] { watch(); });
}

CudaCopyEngine::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(tracker->mutex);
    tracker->stop = true;
    tracker->changed.notify_all();
  }
  watchdog.join();  // before the streams go: it queries them
}

cudaStream_t CudaCopyEngine::Impl::producerStream() const {
#ifdef SHARDEMA_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  return cudaStreamLegacy;
#endif
}

void CudaCopyEngine::Impl::recordProducerPoint() {
  CudaDeviceScope scope(device);
  checkCuda(cudaEventRecord(producerEvent.get(), producerStream()), "cudaEventRecord");
  producerRecorded.store(true, std::memory_order_release);
}

void CudaCopyEngine::Impl::copy(Direction direction, const void* src, void* dst, size_t bytes,
                                CopyEngine::DoneCallback onDone) {
  auto entry = std::make_shared<Pending>();
  entry->onDone = std::move(onDone);
  entry->tracker = tracker;
  CudaDeviceScope scope(device);
  const cudaStream_t stream = streams[direction].get();
  std::lock_guard<std::mutex> queueLock(queueMutex);
  if (producerRecorded.load(std::memory_order_acquire)) {
    checkCuda(cudaStreamWaitEvent(stream, producerEvent.get(), 0), "cudaStreamWaitEvent");
  }
  if (bytes > 0) {
    checkCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
  }
  {
    std::lock_guard<std::mutex> lock(tracker->mutex);
    entry->id = tracker->nextId++;
    tracker->pending.emplace(entry->id, entry);
    tracker->changed.notify_all();  // wakes the watchdog
  }
  auto* holder = new std::shared_ptr<Pending>(entry);
  const cudaError_t status = cudaLaunchHostFunc(stream, &Impl::hostCallback, holder);
  if (status != cudaSuccess) {
    delete holder;
    {
      std::lock_guard<std::mutex> lock(tracker->mutex);
      tracker->pending.erase(entry->id);
      tracker->changed.notify_all();
    }
    checkCuda(status, "cudaLaunchHostFunc");
  }
}

// CUDA's host-callback thread: no CUDA calls allowed here, directly or by
// destroying a capture (see Tracker::finish).
void CUDART_CB CudaCopyEngine::Impl::hostCallback(void* data) {
  auto* holder = static_cast<std::shared_ptr<Pending>*>(data);
  const std::shared_ptr<Pending> entry = std::move(*holder);
  delete holder;
  entry->tracker->finish(entry, nullptr, /*onCudaThread=*/true);
}

void CudaCopyEngine::Impl::Tracker::finish(const std::shared_ptr<Pending>& entry,
                                           std::exception_ptr error, bool onCudaThread) {
  if (entry->claimed.exchange(true, std::memory_order_acq_rel)) return;
  try {
    if (entry->onDone) entry->onDone(error);
  } catch (const std::exception& e) {
    detail::warn(std::string("CudaCopyEngine: a copy's onDone threw (it must not): ") + e.what());
  } catch (...) {
    detail::warn("CudaCopyEngine: a copy's onDone threw (it must not)");
  }
  error = nullptr;
  CopyEngine::DoneCallback done = std::move(entry->onDone);
  entry->onDone = nullptr;
  // Off the CUDA thread captured state goes now, before the entry is erased
  // and so before any synchronize() can return.
  if (!onCudaThread) done = nullptr;
  // Notify with the mutex held: once a waiter sees the entry gone it may
  // destroy the engine, and this thread must not touch it after that (the
  // Tracker itself stays alive through `entry`).
  std::lock_guard<std::mutex> lock(mutex);
  if (done) graveyard.push_back(std::move(done));
  pending.erase(entry->id);
  changed.notify_all();
}

void CudaCopyEngine::Impl::Tracker::buryDead(std::unique_lock<std::mutex>& lock) {
  while (!graveyard.empty()) {
    std::vector<CopyEngine::DoneCallback> dead;
    dead.swap(graveyard);
    lock.unlock();
    dead.clear();  // captures may free pinned/device memory: not on CUDA's thread
    lock.lock();
  }
}

void CudaCopyEngine::Impl::watch() {
  (void)cudaSetDevice(device);  // this thread's CUDA calls go to the engine's device
  Tracker& t = *tracker;
  std::unique_lock<std::mutex> lock(t.mutex);
  auto nextPoll = std::chrono::steady_clock::now() + kWatchdogPeriod;
  while (!t.stop) {
    t.buryDead(lock);
    if (t.pending.empty()) {
      t.changed.wait(lock, [&] { return t.stop || !t.pending.empty() || !t.graveyard.empty(); });
      nextPoll = std::chrono::steady_clock::now() + kWatchdogPeriod;
      continue;
    }
    if (t.changed.wait_until(lock, nextPoll, [&] { return t.stop || !t.graveyard.empty(); })) {
      continue;
    }
    nextPoll = std::chrono::steady_clock::now() + kWatchdogPeriod;
    const uint64_t below = t.nextId;  // copies queued before the query
    lock.unlock();
    cudaError_t status = cudaSuccess;
    for (const CudaStream& stream : streams) {
      const cudaError_t s = cudaStreamQuery(stream.get());
      if (status == cudaSuccess && s != cudaErrorNotReady) status = s;
    }
    if (status != cudaSuccess) failPending(status, "cudaStreamQuery", below);
    lock.lock();
  }
}

// Gives the error to every callback queued before `below` not yet claimed,
// on this (non-CUDA-callback) thread. Lock not held.
void CudaCopyEngine::Impl::failPending(cudaError_t status, const char* call, uint64_t below) {
  std::exception_ptr error;
  try {
    checkCuda(status, call);
  } catch (...) {
    error = std::current_exception();
  }
  std::vector<std::shared_ptr<Pending>> stranded;
  {
    std::lock_guard<std::mutex> lock(tracker->mutex);
    for (const auto& [id, entry] : tracker->pending) {
      if (id < below) stranded.push_back(entry);
    }
  }
  for (const auto& entry : stranded) tracker->finish(entry, error, /*onCudaThread=*/false);
}

void CudaCopyEngine::Impl::fenceProducer() {
  CudaDeviceScope scope(device);
  const cudaStream_t producer = producerStream();
  std::lock_guard<std::mutex> queueLock(queueMutex);  // a consistent cut of both queues
  for (int d = 0; d < 2; ++d) {
    checkCuda(cudaEventRecord(fenceEvents[d].get(), streams[d].get()), "cudaEventRecord");
    checkCuda(cudaStreamWaitEvent(producer, fenceEvents[d].get(), 0), "cudaStreamWaitEvent");
  }
}

// Never throws: an asynchronous CUDA error is delivered to every callback
// still outstanding, the one error channel of the CopyEngine contract.
void CudaCopyEngine::Impl::synchronize() {
  Tracker& t = *tracker;
  uint64_t target = 0;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    target = t.nextId;
  }
  cudaError_t status = cudaSuccess;
  {
    CudaDeviceScope scope(device);
    for (const CudaStream& stream : streams) {
      const cudaError_t s = cudaStreamSynchronize(stream.get());
      if (status == cudaSuccess) status = s;
    }
  }
  if (status != cudaSuccess) failPending(status, "cudaStreamSynchronize", target);
  std::unique_lock<std::mutex> lock(t.mutex);
  t.changed.wait(lock, [&] { return t.pending.empty() || t.pending.begin()->first >= target; });
  t.buryDead(lock);  // captured state goes before synchronize() returns
}

}  // namespace shardema::offload
#endif  // SHARDEMA_HAVE_CUDA
