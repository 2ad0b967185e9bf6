// NCCL behind Communicator, compiled only against a LibTorch with CUDA
// (shard/CMakeLists.txt defines SHARDEMA_TORCH_HAS_CUDA). Not exercised in
// CI: Debian's LibTorch is CPU-only.
#include <c10/util/Exception.h>

#include "communicator_impl.h"

#if defined(SHARDEMA_TORCH_HAS_CUDA)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace shardema {
namespace shard {
namespace detail {

bool ncclCompiled() {
#if defined(SHARDEMA_TORCH_HAS_CUDA)
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<Group> makeNccl(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                   int64_t worldSize, const CommunicatorOptions& options) {
#if defined(SHARDEMA_TORCH_HAS_CUDA)
  auto ncclOptions = c10d::ProcessGroupNCCL::Options::create();
  ncclOptions->timeout = options.timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank),
                                                     static_cast<int>(worldSize), ncclOptions);
#else
  (void)store;
  (void)options;
  TORCH_CHECK(false, "Communicator: CommBackend::kNccl on rank ", rank, " of ", worldSize,
              " needs a LibTorch built with CUDA; this one is CPU-only: use CommBackend::kGloo");
#endif
}

}  // namespace detail
}  // namespace shard
}  // namespace shardema
