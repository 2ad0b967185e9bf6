#pragma once
// Internal to lib/src: the kDevice storage. The EMA lives on each
// source's device and update() runs there synchronously with ATen ops, one
// tensor at a time (the fused _foreach_lerp_ does not exist in LibTorch
// 1.13): the comparison mode. Everything runs on the caller's thread;
// fence() and wait() return at once.
#include <vector>

#include "ema_store.h"
#include "shardema/tracking_policy.h"

namespace shardema {
namespace detail {

class DeviceEmaStore final : public EmaStore {
 public:
  /// Copies every source into storage on its own device.
  DeviceEmaStore(const std::vector<TrackedTensor>& tracked, int numProfiles);

  void update(const std::vector<TrackedTensor>& tracked, const EmaUpdate& update) override;
  void fence() override {}
  void wait() override {}
  bool sourcesReleased() const override { return true; }
  void copyTo(const std::vector<TrackedTensor>& tracked) override;
  offload::PipelineStats stats() const override { return {}; }
};

}  // namespace detail
}  // namespace shardema
