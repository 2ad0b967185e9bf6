#include "shardema/detail/averager_fault_injection.h"

#include <c10/util/Exception.h>

#include <optional>

#include "pinned_host_ema_store.h"

namespace shardema::detail {
namespace {

// Per thread, so tests running Averagers on other threads are not hit.
thread_local std::optional<size_t> failAllocationAt;

}  // namespace

void AveragerFaultInjection::failStorageAllocation(size_t index) { failAllocationAt = index; }

void AveragerFaultInjection::allocatingStorage(size_t index) {
  if (!failAllocationAt || *failAllocationAt != index) return;
  failAllocationAt.reset();
  TORCH_CHECK(false, "AveragerFaultInjection: the EMA storage of tracked tensor ", index,
              " failed to allocate (injected)");
}

void AveragerFaultInjection::inject(Averager& averager, PipelineFault fault) {
  auto* store = dynamic_cast<PinnedHostEmaStore*>(averager.store_.get());
  TORCH_CHECK_VALUE(store != nullptr,
                    "AveragerFaultInjection::inject: the Averager has no pipeline (placement "
                    "kDevice, or moved from)");
  PipelineFaultInjection::inject(store->pipeline(), fault);
}

}  // namespace shardema::detail
