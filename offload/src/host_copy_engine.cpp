#include "shardema/offload/detail/host_copy_engine.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <utility>

#include "shardema/core/warning.h"

namespace shardema::offload {
namespace {

// On the copy thread, so a bad copy fails through onDone as a failed DMA
// would, rather than at queue time.
void copyBytes(const void* src, void* dst, size_t bytes) {
  if (bytes == 0) return;
  TORCH_CHECK_VALUE(src != nullptr && dst != nullptr, "HostCopyEngine: a copy of ", bytes,
                    " bytes needs non-null src and dst, got src ", src, " and dst ", dst);
  std::memcpy(dst, src, bytes);
}

}  // namespace

HostCopyEngine::HostCopyEngine() : thread_([this] { run(); }) {}

HostCopyEngine::~HostCopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  queued_.notify_all();
  thread_.join();
}

void HostCopyEngine::copyToHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) {
  enqueue(src, dst, bytes, std::move(onDone));
}

void HostCopyEngine::copyFromHost(const void* src, void* dst, size_t bytes, DoneCallback onDone) {
  enqueue(src, dst, bytes, std::move(onDone));
}

void HostCopyEngine::enqueue(const void* src, void* dst, size_t bytes, DoneCallback onDone) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stop_, "HostCopyEngine: copy queued while the engine is being destroyed");
    queue_.push_back(QueuedCopy{src, dst, bytes, std::move(onDone)});
    ++submitted_;
  }
  queued_.notify_one();
}

void HostCopyEngine::fenceProducer() {
  uint64_t target = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    target = submitted_;
  }
  waitUntil(&copied_, target);
}

void HostCopyEngine::synchronize() {
  uint64_t target = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    target = submitted_;
  }
  waitUntil(&completed_, target);
}

void HostCopyEngine::waitUntil(const uint64_t* counter, uint64_t target) {
  std::unique_lock<std::mutex> lock(mutex_);
  progress_.wait(lock, [&] { return *counter >= target; });
}

// The copy thread. Queue entries are taken one at a time so a fence waits
// for the copies before it, not for a batch that includes later ones.
void HostCopyEngine::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    queued_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and drained
    QueuedCopy copy = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      copyBytes(copy.src, copy.dst, copy.bytes);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    ++copied_;
    progress_.notify_all();  // with the lock held, like every notify here
    lock.unlock();
    if (copy.onDone) {
      try {
        copy.onDone(error);
      } catch (const std::exception& e) {
        detail::warn(std::string("HostCopyEngine: a copy's onDone threw (it must not): ") +
                     e.what());
      } catch (...) {
        detail::warn("HostCopyEngine: a copy's onDone threw (it must not)");
      }
    }
    error = nullptr;
    copy.onDone = nullptr;  // captured state goes before synchronize() returns
    lock.lock();
    ++completed_;
    progress_.notify_all();
  }
}

}  // namespace shardema::offload
