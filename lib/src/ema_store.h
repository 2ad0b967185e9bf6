#pragma once
// Internal to lib/src: where an Averager's EMA lives and how an
// update reaches it. One implementation per EmaStorage:
//   PinnedHostEmaStore  host memory, the asynchronous chunked pipeline
//   DeviceEmaStore      the sources' device, synchronous ATen ops
// The Averager keeps what both share (names, roles, step and progress, the
// failure mark, the choice of what each due update does); the store is bound
// to the tracked tensors once, at construction (rebind() follows a replaced
// one), owns the EMA storage and the update mechanics, and is handed only
// the decision of each update.
//
// Threads: the Averager's (one caller at a time, see averager.h). Errors
// found on the caller (bad shape or dtype) throw before the EMA changes;
// errors of the background work come from wait(), once.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "shardema/core/prefetch.h"

#include "shardema/core/update_kernels.h"
#include "shardema/offload/pipeline_stats.h"
#include "shardema/tracking_policy.h"

namespace shardema {
namespace detail {

/// One due update, as the Averager decided it.
struct EmaUpdate {
  /// Optimizer step, named in errors.
  int64_t step = 0;
  /// What happens to each tracked tensor, in construction order.
  std::vector<UpdateOp> ops;
  /// 1 - decay per profile (profile 0 first), rounded to float as the
  /// kernels use it.
  std::vector<float> weights;
};

class EmaStore {
 public:
  virtual ~EmaStore() = default;
  EmaStore(const EmaStore&) = delete;
  EmaStore& operator=(const EmaStore&) = delete;

  /// Applies `update` to the bound sources. Throws before anything is
  /// folded in for an error found on the caller (the update may then be
  /// retried). Pinned host: returns once the copies are queued; device:
  /// blocks until done. The caller has waited for the previous update.
  virtual void update(const EmaUpdate& update) = 0;
  /// Blocks until the update in flight has read its sources. Never throws
  /// a background error.
  virtual void fence() = 0;
  /// Blocks until the update in flight is done; rethrows its error once.
  virtual void wait() = 0;
  /// Whether fence() or wait() has run since the last update (or none ran).
  virtual bool sourcesReleased() const = 0;
  /// Writes `profile` into the bound sources (converted to their dtype and
  /// device). Blocks. The caller has waited, checked the profile and
  /// disabled autograd.
  virtual void copyTo(int profile) = 0;
  /// Reads `source` for tracked tensor `index` from now on (the Averager
  /// has checked it against the old one). The caller has waited.
  /// `newWriter`: the source's own version counter from now on (see
  /// Averager::rebindSource).
  void rebind(size_t index, const at::Tensor& source, bool newWriter) {
    bound_[index].source = source;
    if (newWriter) bound_[index].writeVersion = std::nullopt;
    prefetchStale_ = true;  // recorded again by the next update, once
  }
  /// The pipeline's counters (zero for the device store).
  virtual offload::PipelineStats stats() const = 0;

  /// What became of the sources the last update read in the background
  /// (not the ones read inside update()); tracked indices, ascending. Valid
  /// on the caller's thread until the next update; empty for the device
  /// store, which reads everything inside update().
  struct Writes {
    /// Version moved since update() (read now).
    std::vector<size_t> moved;
    /// A chunk check saw the version move before the source's read ended,
    /// or no check could tell (staged through an engine whose copies run
    /// off the host's timeline: CUDA): the EMA may mix values from before
    /// and after the write. Complete once fence() or wait() returned.
    std::vector<size_t> maybeOverlapped;
  };
  virtual Writes writes() const { return {}; }
  /// From the next update on, tracked tensor `index` is read inside
  /// update(), as changesInForward tensors are.
  void readInsideUpdate(size_t index) { bound_[index].changesInForward = true; }
  bool readsInsideUpdate(size_t index) const { return bound_[index].changesInForward; }

  /// The EMA (averaging roles: float32) or the copy (source dtype) of
  /// tracked tensor `index` in `profile`; copies have one tensor shared by
  /// every profile. A view of the store's memory; the caller has waited.
  const at::Tensor& storage(size_t index, int profile) const;

 protected:
  EmaStore() = default;
  /// Where one tensor's storage comes from: (sizes, dtype, source).
  using Allocate =
      std::function<at::Tensor(c10::IntArrayRef, at::ScalarType, const at::Tensor& source)>;
  /// Binds the store to `tracked`, allocates every tracked tensor's storage
  /// (numProfiles tensors for averaging roles, one for copies) and copies
  /// the sources into it.
  void initStorage(const std::vector<TrackedTensor>& tracked, int numProfiles,
                   const Allocate& allocate);
  /// Records in prefetch_ the per-tensor records an update reads (names,
  /// the sources' and the EMAs' TensorImpls and storages).
  void recordPrefetch();

  // Per tracked tensor, in construction order: one tensor per profile
  // (averaging roles) or one shared copy. Written by initStorage only.
  std::vector<std::vector<at::Tensor>> storage_;
  // The tracked tensors, in construction order (rebind() replaces sources).
  std::vector<TrackedTensor> bound_;
  // What an update issues first: with cold caches its per-tensor reads
  // would be a chain of misses taken one by one (core/prefetch.h).
  core::PrefetchList prefetch_;
  bool prefetchStale_ = false;
};

}  // namespace detail
}  // namespace shardema
