// HostCopyEngine under ThreadSanitizer: what the CopyEngine contract
// promises to the pipeline. Copies are queued from several threads at once
// (workers refilling staging slots), callbacks hand work to other threads,
// and the one producer thread relies on fenceProducer()/synchronize() for
// happens-before with the copy thread's writes. No ATen on any thread here.
#include "shardema/offload/detail/host_copy_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shardema::offload {
namespace {

// Each thread's copies complete in the order that thread queued them (the
// FIFO is global), every byte lands, and synchronize() on the producer
// makes every destination and every callback's writes visible.
TEST(HostCopyEngineConcurrencyTest, CopiesFromSeveralThreadsKeepTheirOrder) {
  constexpr int kThreads = 4;
  constexpr int kCopies = 1500;
  constexpr size_t kBytes = 48;
  HostCopyEngine engine;
  std::vector<std::vector<uint8_t>> src(kThreads), dst(kThreads);
  std::vector<std::vector<int>> seen(kThreads);  // written only on the copy thread
  for (int t = 0; t < kThreads; ++t) {
    src[t].resize(kCopies * kBytes);
    for (size_t i = 0; i < src[t].size(); ++i) src[t][i] = static_cast<uint8_t>(i * 7 + t);
    dst[t].assign(src[t].size(), 0);
  }
  std::vector<std::thread> producers;
  for (int t = 0; t < kThreads; ++t) {
    producers.emplace_back([&, t] {
      for (int i = 0; i < kCopies; ++i) {
        engine.copyToHost(src[t].data() + i * kBytes, dst[t].data() + i * kBytes, kBytes,
                          [&seen, t, i](std::exception_ptr) { seen[t].push_back(i); });
      }
    });
  }
  for (std::thread& p : producers) p.join();
  engine.synchronize();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(dst[t], src[t]) << "thread " << t;
    ASSERT_EQ(seen[t].size(), static_cast<size_t>(kCopies));
    for (int i = 0; i < kCopies; ++i) ASSERT_EQ(seen[t][i], i) << "thread " << t;
  }
}

// The pipeline's pattern: the producer queues a round of copies, the
// callbacks hand each landed buffer to a worker thread that reads it and
// may queue a follow-up copy, and the producer overwrites its sources right
// after fenceProducer(). TSan sees any missing happens-before edge; the
// values prove no copy read a source after the fence let it change.
TEST(HostCopyEngineConcurrencyTest, ProducerRewritesSourcesAfterFence) {
  constexpr int kRounds = 200;
  constexpr int kPieces = 4;
  constexpr size_t kWords = 256;
  HostCopyEngine engine;
  std::vector<std::vector<uint32_t>> source(kPieces, std::vector<uint32_t>(kWords));
  std::vector<std::vector<uint32_t>> staged(kPieces, std::vector<uint32_t>(kWords));
  std::vector<std::vector<uint32_t>> echoed(kPieces, std::vector<uint32_t>(kWords));

  std::mutex mutex;
  std::condition_variable changed;
  std::deque<int> landed;  // pieces whose copy is done, guarded by mutex
  bool stop = false;
  std::atomic<int64_t> mismatches{0};
  std::atomic<int> echoes{0};
  std::atomic<int> roundSeen{0};  // the round the worker checks against

  std::thread worker([&] {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return stop || !landed.empty(); });
      if (landed.empty()) return;
      const int piece = landed.front();
      landed.pop_front();
      lock.unlock();
      const uint32_t expected = static_cast<uint32_t>(roundSeen.load() * 131 + piece);
      for (size_t w = 0; w < kWords; ++w) {
        if (staged[piece][w] != expected + w) mismatches.fetch_add(1);
      }
      // A follow-up copy from a worker thread (as a slot refill would be).
      engine.copyFromHost(staged[piece].data(), echoed[piece].data(), kWords * 4,
                          [&echoes](std::exception_ptr) { echoes.fetch_add(1); });
      lock.lock();
    }
  });

  for (int round = 0; round < kRounds; ++round) {
    roundSeen.store(round);
    for (int p = 0; p < kPieces; ++p) {
      for (size_t w = 0; w < kWords; ++w) source[p][w] = static_cast<uint32_t>(round * 131 + p) + w;
    }
    engine.recordProducerPoint();
    for (int p = 0; p < kPieces; ++p) {
      engine.copyToHost(source[p].data(), staged[p].data(), kWords * 4, [&, p](std::exception_ptr) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          landed.push_back(p);
        }
        changed.notify_one();
      });
    }
    engine.fenceProducer();
    // Sources may change now: poison them, as the next optimizer step would.
    for (int p = 0; p < kPieces; ++p) std::memset(source[p].data(), 0xEE, kWords * 4);
    // Wait for the round's math (the worker's reads) before the next round
    // overwrites the staging buffers, as the pipeline's wait() does.
    for (;;) {
      engine.synchronize();
      std::lock_guard<std::mutex> lock(mutex);
      if (landed.empty() && echoes.load() == (round + 1) * kPieces) break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    stop = true;
  }
  changed.notify_all();
  worker.join();
  engine.synchronize();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(echoes.load(), kRounds * kPieces);
  for (int p = 0; p < kPieces; ++p) EXPECT_EQ(echoed[p], staged[p]);
}

// Engines built and destroyed while copies are in flight: the destructor
// drains and joins; no callback runs after it returns.
TEST(HostCopyEngineConcurrencyTest, DestroyWhileBusy) {
  for (int life = 0; life < 20; ++life) {
    std::atomic<int> done{0};
    std::vector<uint8_t> src(4096, static_cast<uint8_t>(life)), dst(4096, 0);
    {
      HostCopyEngine engine;
      std::thread other([&] {
        for (int i = 0; i < 50; ++i) {
          engine.copyToHost(src.data(), dst.data(), src.size(),
                            [&done](std::exception_ptr) { done.fetch_add(1); });
        }
      });
      for (int i = 0; i < 50; ++i) {
        engine.copyFromHost(src.data(), dst.data(), src.size(),
                            [&done](std::exception_ptr) { done.fetch_add(1); });
      }
      other.join();
    }
    ASSERT_EQ(done.load(), 100);
    EXPECT_EQ(dst, src);
  }
}

}  // namespace
}  // namespace shardema::offload
