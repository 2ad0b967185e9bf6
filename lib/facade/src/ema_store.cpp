#include "ema_store.h"

#include "shardema/detail/averager_fault_injection.h"

namespace shardema::detail {

const at::Tensor& EmaStore::storage(size_t index, int profile) const {
  const std::vector<at::Tensor>& profiles = storage_[index];
  return profiles.size() == 1 ? profiles.front() : profiles[static_cast<size_t>(profile)];
}

void EmaStore::initStorage(const std::vector<TrackedTensor>& tracked, int numProfiles,
                           const Allocate& allocate) {
  storage_.reserve(tracked.size());
  for (const TrackedTensor& t : tracked) {
    AveragerFaultInjection::allocatingStorage(storage_.size());
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
