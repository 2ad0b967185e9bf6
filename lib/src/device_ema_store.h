#pragma once
// Internal to lib/src: the EmaStore of EmaStorage::kDevice (what it
// promises: averager.h), ATen ops on each source's device, on the caller's
// thread.
#include <vector>

#include "ema_store.h"
#include "shardema/tracking_policy.h"

namespace shardema {
namespace detail {

class DeviceEmaStore final : public EmaStore {
 public:
  /// Copies every source into storage on its own device.
  DeviceEmaStore(const std::vector<TrackedTensor>& tracked, int numProfiles);

  void update(const EmaUpdate& update) override;
  void fence() override {}
  void wait() override {}
  bool sourcesReleased() const override { return true; }
  void copyTo(int profile) override;
  offload::PipelineStats stats() const override { return {}; }
};

}  // namespace detail
}  // namespace shardema
