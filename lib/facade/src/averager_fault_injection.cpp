#include "shardema/detail/averager_fault_injection.h"

#include <c10/util/Exception.h>

#include "pinned_host_ema_store.h"

namespace shardema::detail {

void AveragerFaultInjection::inject(Averager& averager, PipelineFault fault) {
  auto* store = dynamic_cast<PinnedHostEmaStore*>(averager.store_.get());
  TORCH_CHECK_VALUE(store != nullptr,
                    "AveragerFaultInjection::inject: the Averager has no pipeline (placement "
                    "kDevice, or moved from)");
  PipelineFaultInjection::inject(store->pipeline(), fault);
}

}  // namespace shardema::detail
