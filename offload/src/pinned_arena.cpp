#include "shardema/offload/pinned_arena.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>

#include "shardema/offload/detail/device_probe.h"

#ifdef SHARDEMA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardema::offload {

// A named namespace, not an anonymous one: PinnedArena::Accounts derives
// from Ledger, and a class with external linkage must not have a base
// without it (g++ warns once this file is part of a unity batch).
namespace arena_accounting {

// Shared by the arena and every slab it handed out, so a tensor that
// outlives the arena still has somewhere to report its release.
struct Ledger {
  mutable std::mutex mutex;
  ArenaUsage usage;  // guarded by mutex

  void add(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    usage.bytesInUse += bytes;
    usage.slabsInUse += 1;
    usage.peakBytes = std::max(usage.peakBytes, usage.bytesInUse);
  }
  void remove(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    usage.bytesInUse -= bytes;
    usage.slabsInUse -= 1;
  }
};

}  // namespace arena_accounting

using arena_accounting::Ledger;

struct PinnedArena::Accounts : Ledger {};

namespace {

size_t pageSize() {
  static const size_t size = [] {
    const long page = sysconf(_SC_PAGESIZE);
    return page > 0 ? static_cast<size_t>(page) : size_t{4096};
  }();
  return size;
}

// One allocation; freeing goes back through the same kind.
void* allocateBytes(HostMemoryKind kind, size_t bytes) {
#ifdef SHARDEMA_HAVE_CUDA
  if (kind == HostMemoryKind::kCudaPinned) {
    void* ptr = nullptr;
    // Portable: the staging slots may be used with any device's stream.
    const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      TORCH_CHECK(false, "PinnedArena::allocate: cudaHostAlloc of ", bytes,
                  " bytes failed: ", cudaGetErrorString(status),
                  " (use PinnedArenaOptions::pinWhenDeviceExists = false for pageable memory)");
    }
    return ptr;
  }
#endif
  TORCH_INTERNAL_ASSERT(kind == HostMemoryKind::kPageAligned);
  void* ptr = nullptr;
  const int status = posix_memalign(&ptr, pageSize(), bytes);
  TORCH_CHECK(status == 0 && ptr != nullptr, "PinnedArena::allocate: page-aligned allocation of ",
              bytes, " bytes failed (posix_memalign returned ", status, ")");
  return ptr;
}

void freeBytes(HostMemoryKind kind, void* ptr) noexcept {
#ifdef SHARDEMA_HAVE_CUDA
  if (kind == HostMemoryKind::kCudaPinned) {
    // A deleter cannot throw; a failed free leaks, which beats aborting.
    if (cudaFreeHost(ptr) != cudaSuccess) (void)cudaGetLastError();
    return;
  }
#endif
  (void)kind;
  std::free(ptr);
}

HostMemoryKind chooseKind(const PinnedArenaOptions& options) {
  if (options.pinWhenDeviceExists && probeCudaDevices().deviceCount > 0) {
    return HostMemoryKind::kCudaPinned;
  }
  return HostMemoryKind::kPageAligned;
}

// cudaHostAlloc does not promise page alignment: on an H200 host, small
// pinned allocations came back 512 bytes into a page. Slabs are page
// aligned either way, so a pinned slab asks for one page more and starts
// at the first page boundary inside it.
size_t alignmentSlack(HostMemoryKind kind) {
  return kind == HostMemoryKind::kCudaPinned ? pageSize() : 0;
}

void* pageAlignedInside(void* base) {
  const uintptr_t page = pageSize();
  const uintptr_t address = reinterpret_cast<uintptr_t>(base);
  return reinterpret_cast<void*>((address + page - 1) / page * page);
}

// One allocation with its accounting; freed exactly once, by its destructor.
struct Slab {
  Slab(HostMemoryKind kind, size_t allocBytes, int64_t bytes, std::shared_ptr<Ledger> accounts)
      : kind(kind), bytes(bytes), accounts(std::move(accounts)) {
    base = allocateBytes(kind, allocBytes + alignmentSlack(kind));
    data = pageAlignedInside(base);
    this->accounts->add(bytes);
  }
  ~Slab() {
    freeBytes(kind, base);
    accounts->remove(bytes);
  }
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;

  HostMemoryKind kind;
  int64_t bytes;
  std::shared_ptr<Ledger> accounts;
  void* base = nullptr;  // what was allocated, and is freed
  void* data = nullptr;  // its first page boundary
};

}  // namespace

const char* hostMemoryKindName(HostMemoryKind kind) {
  switch (kind) {
    case HostMemoryKind::kCudaPinned:
      return "cuda_pinned";
    case HostMemoryKind::kPageAligned:
      return "page_aligned";
  }
  return "unknown";
}

PinnedArena::PinnedArena(PinnedArenaOptions options)
    : accounts_(std::make_shared<Accounts>()), kind_(chooseKind(options)) {}

PinnedArena::~PinnedArena() = default;

HostMemoryKind PinnedArena::kind() const { return kind_; }

at::Tensor PinnedArena::allocate(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  for (const int64_t size : sizes) {
    TORCH_CHECK_VALUE(size >= 0, "PinnedArena::allocate: sizes must be >= 0, got ", sizes);
  }
  // A huge shape is a ValueError rather than signed overflow (UB). As in
  // c10 (safe_compute_numel), a zero dimension does not excuse the others.
  int64_t numel = 1;
  bool overflow = false;
  for (const int64_t size : sizes)
    overflow = overflow || __builtin_mul_overflow(numel, size, &numel);
  int64_t bytes = 0;
  overflow = overflow ||
             __builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(dtype)), &bytes);
  TORCH_CHECK_VALUE(!overflow, "PinnedArena::allocate: sizes ", sizes, " of dtype ", dtype,
                    " need more than 2^63 - 1 bytes");
  // Zero-byte tensors still get a real (one page) slab: data_ptr() stays
  // non-null and aligned, and the accounting sees every tensor alike.
  const size_t allocBytes = std::max<size_t>(static_cast<size_t>(bytes), 1);
  auto slab = std::make_shared<Slab>(kind_, allocBytes, bytes, accounts_);
  void* data = slab->data;
  // The slab is freed when the last copy of the deleter goes, which covers
  // both the normal release and from_blob throwing before it took over.
  auto deleter = [slab = std::move(slab)](void*) mutable { slab.reset(); };
  return at::from_blob(data, sizes, std::move(deleter), at::TensorOptions().dtype(dtype));
}

ArenaUsage PinnedArena::usage() const {
  std::lock_guard<std::mutex> lock(accounts_->mutex);
  return accounts_->usage;
}

}  // namespace shardema::offload
