// offload::WorkerPool and the parallel update kernels. Also run under ThreadSanitizer:
// worker threads touch only raw memory and std types, never ATen.
#include "shardema/offload/parallel_update.h"
#include "shardema/offload/worker_pool.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardema/core/update_kernels.h"
#include "support/same_bytes.h"

namespace shardema {
namespace {

TEST(WorkerPoolTest, ParallelForCoversEveryIndexOnce) {
  for (int threads : {0, 1, 3}) {
    offload::WorkerPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {0, 1, 2, 5, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.parallelFor(n, [&](int64_t i) { hits[static_cast<size_t>(i)].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "threads " << threads << " i " << i;
      }
    }
  }
}

TEST(WorkerPoolTest, ParallelForUsesWorkersAndCaller) {
  offload::WorkerPool pool(3);
  std::mutex mutex;
  std::set<std::thread::id> seen;
  pool.parallelFor(64, [&](int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> lock(mutex);
    seen.insert(std::this_thread::get_id());
  });
  EXPECT_GT(seen.size(), 1u) << "all tasks ran on one thread";
}

// The only worker is stuck in a job: the caller must run every task itself.
TEST(WorkerPoolTest, CallerFinishesAloneWhenWorkersAreBusy) {
  offload::WorkerPool pool(1);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  pool.post([released] { released.wait(); });
  std::atomic<int> done{0};
  pool.parallelFor(10, [&](int64_t) { done.fetch_add(1); });
  EXPECT_EQ(done.load(), 10);
  release.set_value();
}

TEST(WorkerPoolTest, NestedParallelForDoesNotDeadlock) {
  offload::WorkerPool pool(2);
  std::atomic<int> done{0};
  pool.parallelFor(8, [&](int64_t) { pool.parallelFor(8, [&](int64_t) { done.fetch_add(1); }); });
  EXPECT_EQ(done.load(), 64);
}

TEST(WorkerPoolTest, ExceptionIsRethrownAfterAllTasksEnded) {
  offload::WorkerPool pool(3);
  std::atomic<int> running{0};
  try {
    pool.parallelFor(100, [&](int64_t i) {
      running.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      running.fetch_sub(1);
      if (i == 3) {
        throw std::runtime_error("task 3 failed");
      }
    });
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "task 3 failed");
  }
  EXPECT_EQ(running.load(), 0) << "parallelFor returned while tasks were still running";
  // The pool stays usable.
  std::atomic<int> after{0};
  pool.parallelFor(10, [&](int64_t) { after.fetch_add(1); });
  EXPECT_EQ(after.load(), 10);
}

TEST(WorkerPoolTest, ConcurrentCallersShareOnePool) {
  offload::WorkerPool pool(2);
  std::vector<std::thread> callers;
  std::vector<int64_t> sums(4, 0);
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 20; ++round) {
        std::vector<int64_t> out(500, 0);
        pool.parallelFor(500, [&](int64_t i) { out[static_cast<size_t>(i)] = i * (c + 1); });
        for (int64_t v : out) {
          sums[c] += v;
        }
      }
    });
  }
  for (std::thread& t : callers) {
    t.join();
  }
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(sums[c], 20 * (c + 1) * (499 * 500 / 2)) << "caller " << c;
  }
}

TEST(WorkerPoolTest, PostRunsAndDestructorJoins) {
  std::atomic<int> done{0};
  std::thread::id worker;
  {
    offload::WorkerPool pool(2);
    for (int i = 0; i < 100; ++i) {
      pool.post([&] {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        done.fetch_add(1);
      });
    }
  }  // the destructor must let all 100 queued jobs finish
  EXPECT_EQ(done.load(), 100);
  offload::WorkerPool inlinePool(0);
  inlinePool.post([&] { worker = std::this_thread::get_id(); });
  EXPECT_EQ(worker, std::this_thread::get_id());
}

TEST(WorkerPoolTest, SharedPoolSizeRule) {
  using offload::WorkerPool;
  // Default: the usable CPUs shared among the node's ranks, less the caller.
  EXPECT_EQ(WorkerPool::poolSizeFor(nullptr, 16, nullptr), 15);
  EXPECT_EQ(WorkerPool::poolSizeFor(nullptr, 16, "8"), 1);
  EXPECT_EQ(WorkerPool::poolSizeFor(nullptr, 64, "4"), 15);
  EXPECT_EQ(WorkerPool::poolSizeFor(nullptr, 2, nullptr), 1);
  EXPECT_EQ(WorkerPool::poolSizeFor(nullptr, 1, nullptr), 1);
  EXPECT_EQ(WorkerPool::poolSizeFor(nullptr, 16, "0"), 15);      // nonsense: ignored
  EXPECT_EQ(WorkerPool::poolSizeFor(nullptr, 16, "eight"), 15);  // nonsense: ignored
  // SHARDEMA_THREADS wins, 0 included.
  EXPECT_EQ(WorkerPool::poolSizeFor("6", 16, "8"), 6);
  EXPECT_EQ(WorkerPool::poolSizeFor("0", 16, nullptr), 0);
  EXPECT_EQ(WorkerPool::poolSizeFor("", 16, nullptr), 15);  // set but empty: unset
  for (const char* bad : {"-1", "two", "3.5", "99999999999"}) {
    try {
      WorkerPool::poolSizeFor(bad, 16, nullptr);
      ADD_FAILURE() << "accepted SHARDEMA_THREADS='" << bad << "'";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("SHARDEMA_THREADS"), std::string::npos) << e.what();
    }
  }
}

TEST(WorkerPoolTest, SharedPoolAndBadSize) {
  EXPECT_GE(offload::WorkerPool::shared().size(), 1);
  EXPECT_EQ(&offload::WorkerPool::shared(), &offload::WorkerPool::shared());
  EXPECT_THROW(offload::WorkerPool(-1), c10::ValueError);
}

// Raw buffers for many spans of mixed type/op/size, filled from a seed.
struct Buffers {
  std::vector<std::vector<float>> emas;
  std::vector<std::vector<uint32_t>> sources;  // fp32 bits, or two 16-bit values per word
  std::vector<UpdateSpan> spans;
};

Buffers makeBuffers(uint64_t seed, int count) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> value(-8.0f, 8.0f);
  Buffers b;
  b.emas.resize(count);
  b.sources.resize(count);
  for (int i = 0; i < count; ++i) {
    const int64_t n = i % 9 == 0 ? 0 : static_cast<int64_t>(rng() % 30000);
    const SourceType type = static_cast<SourceType>(rng() % 3);
    b.emas[i].resize(n);
    for (float& v : b.emas[i]) {
      v = value(rng);
    }
    b.sources[i].resize(n);
    for (uint32_t& w : b.sources[i]) {
      const float f = value(rng);
      std::memcpy(&w, &f, sizeof w);
      // 16-bit types read both halves of a word: clearing bit 14 of each
      // keeps every bf16/fp16 exponent below all-ones (no inf/nan), so
      // float == below is bit equality.
      w = type == SourceType::kFloat32 ? w : (w & 0xbfffbfffu);
    }
    b.spans.push_back({b.emas[i].data(), b.sources[i].data(), type, n,
                       rng() % 3 == 0 ? UpdateOp::kCopy : UpdateOp::kLerp});
  }
  return b;
}

TEST(WorkerPoolTest, ParallelUpdateSpansBitEqualToSerial) {
  Buffers serial = makeBuffers(5, 400);
  updateSpans(serial.spans, 0.001f);
  offload::WorkerPool pool(3);
  for (int64_t grain : {int64_t{1}, int64_t{333}, int64_t{4096}, int64_t{1} << 15}) {
    Buffers parallel = makeBuffers(5, 400);
    offload::updateOnPool(pool, parallel.spans, 0.001f, grain);
    for (size_t i = 0; i < parallel.emas.size(); ++i) {
      ASSERT_TRUE(testing::sameBytes(parallel.emas[i].data(), serial.emas[i].data(),
                                     parallel.emas[i].size() * sizeof(float)))
          << "grain " << grain << " span " << i;
    }
  }
}

// Two threads update disjoint span sets through one pool at the same time.
TEST(WorkerPoolTest, ConcurrentUpdateSpansCallers) {
  Buffers expectA = makeBuffers(7, 150), expectB = makeBuffers(8, 150);
  updateSpans(expectA.spans, 0.5f);
  updateSpans(expectB.spans, 0.5f);
  Buffers a = makeBuffers(7, 150), b = makeBuffers(8, 150);
  offload::WorkerPool pool(2);
  std::thread other([&] { offload::updateOnPool(pool, b.spans, 0.5f, 1000); });
  offload::updateOnPool(pool, a.spans, 0.5f, 1000);
  other.join();
  EXPECT_EQ(a.emas, expectA.emas);
  EXPECT_EQ(b.emas, expectB.emas);
}

}  // namespace
}  // namespace shardema
