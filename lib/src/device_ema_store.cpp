#include "device_ema_store.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "shardema/core/tensor_update.h"

namespace shardema::detail {

DeviceEmaStore::DeviceEmaStore(const std::vector<TrackedTensor>& tracked, int numProfiles) {
  initStorage(tracked, numProfiles,
              [](c10::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor& source) {
                return at::empty(sizes, at::TensorOptions().dtype(dtype).device(source.device()));
              });
}

// ema + w * (x - ema) in float32 with the three roundings of the CPU kernels
// (sub, mul, add), so on CPU tensors it matches the pinned host store bit
// for bit.
void DeviceEmaStore::update(const EmaUpdate& update) {
  const std::vector<TrackedTensor>& tracked = bound_;
  // Every tensor is checked before the first is written.
  for (size_t i = 0; i < tracked.size(); ++i) {
    const TrackedTensor& t = tracked[i];
    const at::Tensor& ema = storage(i, 0);
    if (isAveragingRole(t.role)) sourceTypeOf(t.source, t.name);
    TORCH_CHECK_VALUE(t.source.device() == ema.device() && t.source.sizes() == ema.sizes(),
                      "Averager::update: tensor '", t.name, "' is now ", t.source.sizes(), " on ",
                      t.source.device(), " but its EMA is ", ema.sizes(), " on ", ema.device(),
                      " (storage kDevice keeps the EMA where the source was)");
  }
  c10::NoGradGuard noGrad;
  for (size_t i = 0; i < tracked.size(); ++i) {
    const UpdateOp op = update.ops[i];
    if (op == UpdateOp::kSkip) continue;
    const at::Tensor source = tracked[i].source.detach();
    for (size_t p = 0; p < storage_[i].size(); ++p) {  // copies: one, shared
      const at::Tensor& ema = storage_[i][p];
      if (op != UpdateOp::kLerp) {  // kCopy converts, kCopyRaw keeps the dtype
        ema.copy_(source);
        continue;
      }
      const double w = update.weights[p];
      ema.add_(source.to(at::kFloat).sub(ema).mul_(w));
    }
  }
}

void DeviceEmaStore::copyTo(int profile) {
  for (size_t i = 0; i < bound_.size(); ++i) bound_[i].source.detach().copy_(storage(i, profile));
}

}  // namespace shardema::detail
