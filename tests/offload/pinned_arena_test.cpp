#include "shardema/offload/pinned_arena.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "shardema/offload/detail/device_probe.h"
#include "support/value_error.h"

namespace shardema::offload {
namespace {

bool deviceAvailable() { return probeCudaDevices().deviceCount > 0; }

TEST(PinnedArenaTest, KindFollowsDeviceAndOptions) {
  PinnedArena arena;
  EXPECT_EQ(arena.kind(),
            deviceAvailable() ? HostMemoryKind::kCudaPinned : HostMemoryKind::kPageAligned);
  PinnedArenaOptions pageable;
  pageable.pinWhenDeviceExists = false;
  EXPECT_EQ(PinnedArena(pageable).kind(), HostMemoryKind::kPageAligned);
  EXPECT_STREQ(hostMemoryKindName(HostMemoryKind::kCudaPinned), "cuda_pinned");
  EXPECT_STREQ(hostMemoryKindName(HostMemoryKind::kPageAligned), "page_aligned");
}

// Every slab starts on a page boundary, whatever its size (0 and odd ones
// included), and has the shape, dtype and contiguity asked for.
TEST(PinnedArenaTest, SlabsArePageAlignedContiguousCpuTensors) {
  PinnedArena arena;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (const int64_t n : {0, 1, 3, 1000, 4097, 1 << 20}) {
    at::Tensor t = arena.allocate({n}, at::kFloat);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % page, 0u) << "n=" << n;
    EXPECT_TRUE(t.device().is_cpu());
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.numel(), n);
    EXPECT_EQ(t.scalar_type(), at::kFloat);
  }
  at::Tensor matrix = arena.allocate({3, 5, 7}, at::kDouble);
  EXPECT_EQ(matrix.sizes(), (std::vector<int64_t>{3, 5, 7}));
  EXPECT_EQ(matrix.nbytes(), 3u * 5 * 7 * 8);
}

// bytesInUse/slabsInUse follow live tensors (views keep a slab alive),
// peakBytes keeps the high-water mark, and all return to 0.
TEST(PinnedArenaTest, AccountsWhatLiveTensorsHold) {
  PinnedArena arena;
  EXPECT_EQ(arena.usage().bytesInUse, 0);
  at::Tensor a = arena.allocate({100}, at::kFloat);        // 400 bytes
  at::Tensor b = arena.allocate({10, 10}, at::kBFloat16);  // 200 bytes
  EXPECT_EQ(arena.usage().bytesInUse, 600);
  EXPECT_EQ(arena.usage().slabsInUse, 2);
  at::Tensor view = a.narrow(0, 10, 5);
  a = at::Tensor();
  EXPECT_EQ(arena.usage().bytesInUse, 600) << "a view keeps its slab alive";
  view = at::Tensor();
  EXPECT_EQ(arena.usage().bytesInUse, 200);
  EXPECT_EQ(arena.usage().slabsInUse, 1);
  at::Tensor c = arena.allocate({50}, at::kByte);
  EXPECT_EQ(arena.usage().bytesInUse, 250);
  b = at::Tensor();
  c = at::Tensor();
  const ArenaUsage usage = arena.usage();
  EXPECT_EQ(usage.bytesInUse, 0);
  EXPECT_EQ(usage.slabsInUse, 0);
  EXPECT_EQ(usage.peakBytes, 600);
}

// A tensor may outlive its arena; its memory stays readable and writable
// and is freed (by ASan's account, too) when the tensor goes.
TEST(PinnedArenaTest, TensorsOutliveTheArena) {
  at::Tensor survivor;
  {
    PinnedArena arena;
    survivor = arena.allocate({1024}, at::kInt);
    survivor.fill_(7);
  }
  survivor.add_(1);
  EXPECT_EQ(survivor.sum().item<int64_t>(), 8 * 1024);
  survivor = at::Tensor();
}

// The memory is ours, byte-addressable, and bf16 views of it behave like
// ATen's own bf16 tensors.
TEST(PinnedArenaTest, HoldsBf16ValuesAndRawBytes) {
  PinnedArena arena;
  at::Tensor bf = arena.allocate({257}, at::kBFloat16);
  at::Tensor reference = at::empty({257}, at::kFloat);
  for (int64_t i = 0; i < 257; ++i) reference[i] = static_cast<float>(i) * 0.5f - 30.0f;
  bf.copy_(reference);
  EXPECT_TRUE(bf.to(at::kFloat).equal(reference.to(at::kBFloat16).to(at::kFloat)));
  at::Tensor bytes = arena.allocate({4096}, at::kByte);
  std::memset(bytes.data_ptr(), 0xAB, 4096);
  EXPECT_EQ(bytes.view(at::kBFloat16).numel(), 2048);
  EXPECT_EQ(bytes[4095].item<int64_t>(), 0xAB);
}

TEST(PinnedArenaTest, NegativeSizeIsAValueError) {
  PinnedArena arena;
  try {
    arena.allocate({4, -1}, at::kFloat);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("PinnedArena::allocate"),
              std::string::npos);
  }
  EXPECT_EQ(arena.usage().slabsInUse, 0);
}

// Shapes whose element count or byte count exceeds int64 are a ValueError
// naming the shape and dtype (not signed overflow and a tiny slab).
TEST(PinnedArenaTest, OverflowingShapeIsAValueError) {
  PinnedArena arena;
  const int64_t big = int64_t{1} << 32;
  // numel itself overflows: 2^32 * 2^32.
  EXPECT_VALUE_ERROR(arena.allocate({big, big}, at::kFloat), "[4294967296, 4294967296]");
  // numel fits (2^62) but numel * 4 bytes does not; the message names the dtype.
  EXPECT_VALUE_ERROR(arena.allocate({int64_t{1} << 62}, at::kFloat), "Float");
  EXPECT_VALUE_ERROR(arena.allocate({int64_t{1} << 62}, at::kFloat), "PinnedArena::allocate");
  EXPECT_EQ(arena.usage().slabsInUse, 0);
  // A zero dimension still makes an empty tensor.
  EXPECT_EQ(arena.allocate({big, 0}, at::kFloat).numel(), 0);
  // c10 itself refuses this shape; here it is a ValueError naming it.
  EXPECT_VALUE_ERROR(arena.allocate({big, big, 0}, at::kFloat), "[4294967296, 4294967296, 0]");
}

// Allocation and release from several threads at once keep the books.
TEST(PinnedArenaTest, ThreadSafeAccounting) {
  PinnedArena arena;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&arena, t] {
      for (int i = 0; i < 200; ++i) {
        at::Tensor x = arena.allocate({(t + 1) * 16 + i}, at::kByte);
        static_cast<uint8_t*>(x.data_ptr())[0] = static_cast<uint8_t>(i);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(arena.usage().bytesInUse, 0);
  EXPECT_EQ(arena.usage().slabsInUse, 0);
  EXPECT_GT(arena.usage().peakBytes, 0);
}

}  // namespace
}  // namespace shardema::offload
