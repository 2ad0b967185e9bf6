// NCCL behind Communicator, compiled against a LibTorch with CUDA
// (shard/CMakeLists.txt defines SHARDEMA_TORCH_HAS_CUDA; PyPI's torch is
// one). Compiled and linked in every CI build; it runs only where a CUDA
// device is (bench/gpu/run.sh). Without one it refuses before c10d does,
// with a message that says so.
#include <c10/util/Exception.h>

#include "communicator_impl.h"

#if defined(SHARDEMA_TORCH_HAS_CUDA)
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace shardema {
namespace shard {
namespace detail {

void requireNccl(int64_t rank, int64_t worldSize) {
#if defined(SHARDEMA_TORCH_HAS_CUDA)
  // device_count() is 0, not an error, without a driver or a device.
  TORCH_CHECK(c10::cuda::device_count() > 0, "Communicator: CommBackend::kNccl on rank ", rank,
              " of ", worldSize, " needs a CUDA device and this process sees none (no driver, ",
              "or CUDA_VISIBLE_DEVICES hides them): use CommBackend::kGloo");
#else
  TORCH_CHECK(false, "Communicator: CommBackend::kNccl on rank ", rank, " of ", worldSize,
              " needs a LibTorch built with CUDA; this one is CPU-only: use CommBackend::kGloo");
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
  requireNccl(rank, worldSize);
  return {};
#endif
}

}  // namespace detail
}  // namespace shard
}  // namespace shardema
