// CudaCopyEngine on a real device: copies land, they wait for the producer
// stream's earlier kernels, and fenceProducer() holds the producer's later
// kernels back until the copies have read/written. Every test skips
// without a device (CI); bench/gpu/run.sh runs them on a GPU machine.
// Device tensors come from ATen, so the ordering tests also need a CUDA
// LibTorch (their kernels run on c10's current stream, the engine's
// producer stream in such a build).
#include "shardema/offload/detail/cuda_copy_engine.h"

#include <ATen/Context.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "shardema/offload/detail/device_probe.h"
#include "shardema/offload/pinned_arena.h"

namespace shardema::offload {
namespace {

#define SKIP_WITHOUT_DEVICE()                                                 \
  do {                                                                        \
    if (!CudaCopyEngine::compiledIn() || probeCudaDevices().deviceCount == 0) \
      GTEST_SKIP() << "no CUDA device: " << probeCudaDevices().reason;        \
  } while (0)

#define SKIP_WITHOUT_TORCH_CUDA()                                    \
  do {                                                               \
    SKIP_WITHOUT_DEVICE();                                           \
    if (!at::hasCUDA()) GTEST_SKIP() << "this LibTorch has no CUDA"; \
  } while (0)

at::TensorOptions onDevice(at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(at::kCUDA);
}

// Pinned host to pinned host through the copy streams (no ATen CUDA needed).
TEST(CudaCopyEngineTest, HostToHostCopiesLandInOrder) {
  SKIP_WITHOUT_DEVICE();
  PinnedArena arena;
  ASSERT_EQ(arena.kind(), HostMemoryKind::kCudaPinned);
  CudaCopyEngine engine;
  EXPECT_STREQ(engine.name(), "cuda");
  at::Tensor src = arena.allocate({1 << 20}, at::kByte);
  at::Tensor dst = arena.allocate({1 << 20}, at::kByte);
  auto* s = static_cast<uint8_t*>(src.data_ptr());
  for (int i = 0; i < (1 << 20); ++i) s[i] = static_cast<uint8_t>(i * 31 + 7);
  std::memset(dst.data_ptr(), 0, 1 << 20);
  std::mutex mutex;
  std::vector<int> order;
  engine.recordProducerPoint();
  for (int piece = 0; piece < 64; ++piece) {
    const size_t offset = static_cast<size_t>(piece) << 14;
    engine.copyToHost(s + offset, static_cast<uint8_t*>(dst.data_ptr()) + offset, 1 << 14,
                      [&, piece](std::exception_ptr e) {
                        std::lock_guard<std::mutex> lock(mutex);
                        order.push_back(e ? -1 : piece);
                      });
  }
  engine.synchronize();
  EXPECT_EQ(std::memcmp(src.data_ptr(), dst.data_ptr(), 1 << 20), 0);
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_EQ(order.size(), 64u);
  for (int piece = 0; piece < 64; ++piece) EXPECT_EQ(order[piece], piece);
}

// D2H into pinned memory and H2D back, compared with a CPU reference.
TEST(CudaCopyEngineTest, DeviceRoundTripIsExact) {
  SKIP_WITHOUT_TORCH_CUDA();
  const int64_t n = (int64_t{3} << 20) + 5;
  PinnedArena arena;
  CudaCopyEngine engine;
  const at::Tensor reference = at::arange(n, at::kFloat);
  at::Tensor device = at::arange(n, onDevice(at::kFloat));
  at::Tensor host = arena.allocate({n}, at::kFloat);
  std::atomic<int> ok{0};
  auto count = [&ok](std::exception_ptr e) { ok += e ? 0 : 1; };
  engine.recordProducerPoint();
  engine.copyToHost(device.data_ptr(), host.data_ptr(), host.nbytes(), count);
  engine.synchronize();
  EXPECT_TRUE(host.equal(reference));
  at::Tensor back = at::zeros({n}, onDevice(at::kFloat));
  engine.recordProducerPoint();
  engine.copyFromHost(host.data_ptr(), back.data_ptr(), host.nbytes(), count);
  engine.synchronize();
  EXPECT_TRUE(back.cpu().equal(reference));
  EXPECT_EQ(ok.load(), 2);
}

// The copy must see what the producer stream's kernels wrote before
// recordProducerPoint(), even though they are still queued behind slow
// matmuls when the copy is issued: without the event the copy would read
// zeros (or garbage) on its non-blocking stream.
TEST(CudaCopyEngineTest, CopiesWaitForTheProducerStream) {
  SKIP_WITHOUT_TORCH_CUDA();
  const int64_t n = int64_t{1} << 24;
  PinnedArena arena;
  CudaCopyEngine engine;
  at::Tensor host = arena.allocate({n}, at::kFloat);
  for (int trial = 0; trial < 3; ++trial) {
    at::Tensor src = at::zeros({n}, onDevice(at::kFloat));
    at::Tensor a = at::randn({4096, 4096}, onDevice(at::kFloat));
    for (int i = 0; i < 40; ++i) a = at::mm(a, a).mul_(1e-3);  // keeps the stream busy
    src.fill_(7.0 + trial);
    engine.recordProducerPoint();
    engine.copyToHost(src.data_ptr(), host.data_ptr(), host.nbytes(), nullptr);
    engine.synchronize();
    EXPECT_TRUE(host.eq(7.0 + trial).all().item<bool>()) << "trial " << trial;
  }
}

// After fenceProducer() the producer may overwrite the source: kernels
// queued afterwards on the producer stream must wait for the D2H copy, and
// kernels that read an H2D destination must see the copied bytes.
TEST(CudaCopyEngineTest, FenceHoldsTheProducerBack) {
  SKIP_WITHOUT_TORCH_CUDA();
  const int64_t n = int64_t{64} << 20;  // 256 MiB: milliseconds of copy
  PinnedArena arena;
  CudaCopyEngine engine;
  at::Tensor host = arena.allocate({n}, at::kFloat);
  for (int trial = 0; trial < 3; ++trial) {
    at::Tensor src = at::full({n}, 1.0 + trial, onDevice(at::kFloat));
    engine.recordProducerPoint();
    engine.copyToHost(src.data_ptr(), host.data_ptr(), host.nbytes(), nullptr);
    engine.fenceProducer();
    src.fill_(-1.0);  // the next optimizer step
    engine.synchronize();
    EXPECT_TRUE(host.eq(1.0 + trial).all().item<bool>()) << "D2H trial " << trial;

    host.fill_(5.0 + trial);
    at::Tensor dst = at::zeros({n}, onDevice(at::kFloat));
    engine.recordProducerPoint();
    engine.copyFromHost(host.data_ptr(), dst.data_ptr(), host.nbytes(), nullptr);
    engine.fenceProducer();
    const double total = dst.sum(at::kDouble).item<double>();  // on the producer stream
    EXPECT_EQ(total, static_cast<double>(n) * (5.0 + trial)) << "H2D trial " << trial;
    engine.synchronize();
  }
}

}  // namespace
}  // namespace shardema::offload
