#include "ema_store.h"

#include <c10/util/Exception.h>

#include "shardema/core/failpoint.h"

namespace shardema::detail {

const at::Tensor& EmaStore::storage(size_t index, int profile) const {
  const std::vector<at::Tensor>& profiles = storage_[index];
  return profiles.size() == 1 ? profiles.front() : profiles[static_cast<size_t>(profile)];
}

void EmaStore::initStorage(const std::vector<TrackedTensor>& tracked, int numProfiles,
                           const Allocate& allocate) {
  bound_ = tracked;
  storage_.reserve(tracked.size());
  for (const TrackedTensor& t : tracked) {
    TORCH_CHECK(
        !failpoint::fires("lib.ema_storage.allocate", static_cast<int64_t>(storage_.size())),
        "the EMA storage of tracked tensor ", storage_.size(),
        " failed to allocate (failpoint lib.ema_storage.allocate)");
    const bool averaged = isAveragingRole(t.role);
    const at::ScalarType dtype = averaged ? at::kFloat : t.source.scalar_type();
    std::vector<at::Tensor> profiles;
    for (int p = 0; p < (averaged ? numProfiles : 1); ++p) {
      at::Tensor storage = allocate(t.source.sizes(), dtype, t.source);
      storage.copy_(t.source.detach());
      profiles.push_back(std::move(storage));
    }
    storage_.push_back(std::move(profiles));
  }
  recordPrefetch();
}

void EmaStore::recordPrefetch() {
  // Sizes: a TensorImpl's fields an update reads span its first 256
  // bytes; a StorageImpl's data pointer and size its first 128. Only the
  // sources: an update of the same tensors reads no EMA tensor and no name
  // (the pipeline keeps what it checked of the EMAs, the jobs their
  // handles: pinned_host_ema_store.cpp).
  const auto addTensor = [this](const at::Tensor& t) {
    if (!t.defined()) return;
    prefetch_.add(t.unsafeGetTensorImpl(), 256);
    if (t.has_storage()) prefetch_.add(t.storage().unsafeGetStorageImpl(), 128);
  };
  prefetch_.clear();
  prefetchStale_ = false;
  for (size_t i = 0; i < bound_.size() && i < storage_.size(); ++i) {
    addTensor(bound_[i].source);
    // The version counter each update reads (PipelineJob::version, or the
    // source's own); a DTensor's handle is also copied (its reference
    // count written).
    const at::Tensor& source = bound_[i].source;
    if (bound_[i].writeVersion) {
      prefetch_.addForWrite(core::versionCounterAddress(*bound_[i].writeVersion));
    } else if (source.defined()) {
      prefetch_.add(core::versionCounterAddress(source.unsafeGetTensorImpl()->version_counter()));
    }
  }
}

}  // namespace shardema::detail
