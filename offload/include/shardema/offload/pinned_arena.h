#pragma once
// PinnedArena: host memory the copy engine can DMA into. cudaHostAlloc when
// a CUDA device is present (page-locked: async D2H/H2D), page-aligned host
// memory otherwise. Slabs are handed out as at::Tensors whose deleter gives
// the memory back; the arena accounts what is out.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <memory>

namespace shardema {
namespace offload {

enum class HostMemoryKind {
  /// cudaHostAlloc (portable, page-locked).
  kCudaPinned,
  /// aligned to the page size, pageable (no device, or pinning refused).
  kPageAligned,
};

const char* hostMemoryKindName(HostMemoryKind kind);  // "cuda_pinned", "page_aligned"

struct PinnedArenaOptions {
  /// true (default): page-locked memory when a CUDA device exists. false:
  /// always page-aligned host memory (pinning large EMAs can starve the OS of
  /// lockable memory; the copy engine then stages through its own slots).
  bool pinWhenDeviceExists = true;
};

/// Byte counts of one arena.
struct ArenaUsage {
  int64_t bytesInUse = 0;  // held by live tensors now
  int64_t peakBytes = 0;   // high-water mark of bytesInUse
  int64_t slabsInUse = 0;  // live allocations
};

class PinnedArena {
 public:
  explicit PinnedArena(PinnedArenaOptions options = {});
  /// Tensors already handed out stay valid after the arena is gone (each
  /// slab keeps what it needs to free itself).
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  HostMemoryKind kind() const;
  /// A new contiguous CPU tensor of the given shape and dtype (contents
  /// uninitialised) in this arena's memory; freed when its last view goes.
  /// Thread-safe. c10::Error naming the byte count when allocation fails.
  at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype);
  ArenaUsage usage() const;

 private:
  struct Accounts;
  std::shared_ptr<Accounts> accounts_;
  HostMemoryKind kind_;
};

}  // namespace offload
}  // namespace shardema
