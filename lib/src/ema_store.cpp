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
}

}  // namespace shardema::detail
