#pragma once
// Software prefetch of memory a loop is about to read. Walking many small
// heap objects through pointers (a model's tensors: Python objects,
// TensorImpls, storages, version counters) with cold caches is a chain of
// dependent misses, one memory latency each. A PrefetchList records the
// addresses one pass touched; the next pass first issues them all, with no
// dependent load, so their misses overlap. Addresses may have gone stale
// in between (a tensor replaced): a prefetch is a hint and never faults.
#include <c10/core/TensorImpl.h>

#include <cstddef>
#include <cstring>
#include <vector>

namespace shardema::core {

inline void prefetchForRead(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(address, /*rw=*/0, /*locality=*/3);
#else
  (void)address;
#endif
}

inline void prefetchForWrite(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(address, /*rw=*/1, /*locality=*/3);
#else
  (void)address;
#endif
}

/// The counter object a version handle shares, to prefetch before the
/// handle is copied (an atomic increment of a reference count on the
/// counter's line). VariableVersion's one member is an intrusive_ptr to
/// it; null for a disabled handle. An address for prefetching only.
inline const void* versionCounterAddress(const c10::VariableVersion& version) {
  static_assert(sizeof(c10::VariableVersion) == sizeof(void*),
                "c10::VariableVersion is no longer one pointer: update versionCounterAddress");
  const void* counter = nullptr;
  std::memcpy(&counter, &version, sizeof counter);
  return counter;
}

class PrefetchList {
 public:
  /// Forget the recorded addresses (keeps the capacity).
  void clear() {
    lines_.clear();
    writeLines_.clear();
  }
  /// Record the `bytes` from `address` on (64-byte lines); null is skipped.
  void add(const void* address, size_t bytes = 1) {
    if (address == nullptr) return;
    const char* p = static_cast<const char*>(address);
    for (size_t offset = 0; offset < bytes; offset += 64) lines_.push_back(p + offset);
  }
  /// Record one line that will be written (a reference count).
  void addForWrite(const void* address) {
    if (address != nullptr) writeLines_.push_back(address);
  }
  /// Prefetch every recorded line.
  void issue() const {
    for (const void* line : lines_) prefetchForRead(line);
    for (const void* line : writeLines_) prefetchForWrite(line);
  }

 private:
  std::vector<const void*> lines_;
  std::vector<const void*> writeLines_;
};

}  // namespace shardema::core
