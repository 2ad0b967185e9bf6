// HostCopyEngine's protocol and makeCopyEngine's choice. The CUDA engine's
// own tests are in cuda_copy_engine_test.cpp (they need a device).
#include "shardema/offload/copy_engine.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardema/offload/detail/cuda_copy_engine.h"
#include "shardema/offload/detail/device_probe.h"
#include "shardema/offload/detail/host_copy_engine.h"

namespace shardema::offload {
namespace {

using namespace std::chrono_literals;

std::vector<uint8_t> randomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

std::string errorMessage(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (...) {
    return "<not a c10::Error>";
  }
}

// Sizes include 0 and odd counts; both directions; every byte compared.
TEST(HostCopyEngineTest, CopiesLandByteExact) {
  HostCopyEngine engine;
  EXPECT_STREQ(engine.name(), "host");
  const std::vector<size_t> sizes = {0, 1, 7, 64, 4095, 4096, (size_t{1} << 20) + 3};
  std::vector<std::vector<uint8_t>> sources, toHost, fromHost;
  std::atomic<int> ok{0};
  for (size_t i = 0; i < sizes.size(); ++i) {
    sources.push_back(randomBytes(sizes[i], static_cast<uint32_t>(i)));
    toHost.emplace_back(sizes[i], 0);
    fromHost.emplace_back(sizes[i], 0);
  }
  engine.recordProducerPoint();
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto count = [&ok](std::exception_ptr e) { ok += e ? 0 : 1; };
    engine.copyToHost(sources[i].data(), toHost[i].data(), sizes[i], count);
    engine.copyFromHost(sources[i].data(), fromHost[i].data(), sizes[i], count);
  }
  engine.synchronize();
  EXPECT_EQ(ok.load(), 2 * static_cast<int>(sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(toHost[i], sources[i]) << "size " << sizes[i];
    EXPECT_EQ(fromHost[i], sources[i]) << "size " << sizes[i];
  }
}

// Callbacks run in queue order (both directions share the FIFO), on one
// thread that is not the caller's.
TEST(HostCopyEngineTest, CallbacksRunInFifoOrderOnTheCopyThread) {
  HostCopyEngine engine;
  std::mutex mutex;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  uint8_t src[32] = {}, dst[32];
  for (int i = 0; i < 200; ++i) {
    auto onDone = [&, i](std::exception_ptr) {
      std::lock_guard<std::mutex> lock(mutex);
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
    };
    if (i % 2 == 0) {
      engine.copyToHost(src, dst, sizeof(src), onDone);
    } else {
      engine.copyFromHost(src, dst, sizeof(src), onDone);
    }
  }
  engine.synchronize();
  std::lock_guard<std::mutex> lock(mutex);
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
  for (const std::thread::id& id : threads) {
    EXPECT_EQ(id, threads.front());
    EXPECT_NE(id, std::this_thread::get_id());
  }
}

// fenceProducer returns only once every earlier copy has landed (a large
// copy takes milliseconds, so a fence that returned at once would see a
// partial destination), but does not wait for the last callback.
TEST(HostCopyEngineTest, FenceWaitsForEarlierCopiesNotCallbacks) {
  HostCopyEngine engine;
  const size_t big = size_t{96} << 20;
  const std::vector<uint8_t> source = randomBytes(big, 11);
  std::vector<uint8_t> first(big, 0), second(4096, 0);
  std::atomic<bool> release{false}, lastCallbackDone{false};
  engine.copyToHost(source.data(), first.data(), big, nullptr);
  engine.copyToHost(source.data(), second.data(), second.size(), [&](std::exception_ptr) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!release.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    lastCallbackDone = true;
  });
  engine.fenceProducer();
  EXPECT_FALSE(lastCallbackDone.load()) << "the fence waited for a callback";
  EXPECT_EQ(std::memcmp(first.data(), source.data(), big), 0);
  EXPECT_EQ(std::memcmp(second.data(), source.data(), second.size()), 0);
  release = true;
  engine.synchronize();
  EXPECT_TRUE(lastCallbackDone.load());
}

// synchronize waits for every callback to return, slow ones included.
TEST(HostCopyEngineTest, SynchronizeWaitsForCallbacks) {
  HostCopyEngine engine;
  std::atomic<int> done{0};
  uint8_t src[8] = {1, 2, 3, 4, 5, 6, 7, 8}, dst[8];
  for (int i = 0; i < 5; ++i) {
    engine.copyToHost(src, dst, 8, [&](std::exception_ptr) {
      std::this_thread::sleep_for(20ms);
      ++done;
    });
  }
  engine.synchronize();
  EXPECT_EQ(done.load(), 5);
  engine.synchronize();  // nothing queued: returns at once
}

// A failed copy reports a c10::Error to its own onDone; the engine goes on.
TEST(HostCopyEngineTest, ErrorsGoToOnDone) {
  HostCopyEngine engine;
  std::exception_ptr failed, succeeded;
  std::atomic<int> calls{0};
  uint8_t src[16] = {9}, dst[16] = {};
  engine.copyToHost(nullptr, dst, 16, [&](std::exception_ptr e) {
    failed = e;
    ++calls;
  });
  engine.copyFromHost(src, dst, 16, [&](std::exception_ptr e) {
    succeeded = e;
    ++calls;
  });
  engine.synchronize();
  ASSERT_EQ(calls.load(), 2);
  ASSERT_TRUE(failed);
  EXPECT_NE(errorMessage(failed).find("HostCopyEngine"), std::string::npos) << errorMessage(failed);
  EXPECT_NE(errorMessage(failed).find("16 bytes"), std::string::npos) << errorMessage(failed);
  EXPECT_FALSE(succeeded);
  EXPECT_EQ(dst[0], 9);
}

// A callback that throws (forbidden) does not stop the engine.
TEST(HostCopyEngineTest, ThrowingCallbackDoesNotStopTheEngine) {
  HostCopyEngine engine;
  uint8_t src[4] = {1, 2, 3, 4}, dst[4] = {};
  std::atomic<bool> later{false};
  engine.copyToHost(src, dst, 4, [](std::exception_ptr) { throw std::runtime_error("bad"); });
  engine.copyToHost(src, dst, 4, [&](std::exception_ptr) { later = true; });
  engine.synchronize();
  EXPECT_TRUE(later.load());
}

// The destructor runs every queued copy and callback before returning.
TEST(HostCopyEngineTest, DestructorDrains) {
  const std::vector<uint8_t> source = randomBytes(1 << 16, 5);
  std::vector<std::vector<uint8_t>> dst(50, std::vector<uint8_t>(source.size(), 0));
  std::atomic<int> done{0};
  {
    HostCopyEngine engine;
    for (auto& d : dst) {
      engine.copyToHost(source.data(), d.data(), source.size(), [&](std::exception_ptr) {
        std::this_thread::sleep_for(100us);
        ++done;
      });
    }
  }
  EXPECT_EQ(done.load(), 50);
  for (const auto& d : dst) EXPECT_EQ(d, source);
}

// The first engine of a process (its own suite: ctest runs each suite in a
// fresh process, so the probe runs here): kAuto warns only where a driver
// is installed and no device can be used. A machine without a GPU, or one
// whose GPU works, gets no warning.
TEST(AutoEngineWarningTest, AutoWarnsOnlyAboutAGpuThatCannotBeUsed) {
  struct Recorder : c10::WarningHandler {
    void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
    std::vector<std::string> messages;
  } recorder;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&recorder);
    makeCopyEngine(EngineChoice::kAuto);
    makeCopyEngine(EngineChoice::kAuto);
  }
  const DeviceProbe& probe = probeCudaDevices();
  if (!probe.unusableDevice) {
    EXPECT_TRUE(recorder.messages.empty())
        << "nothing to warn about (" << probe.reason << "), got: " << recorder.messages.front();
    return;
  }
  ASSERT_EQ(recorder.messages.size(), 1u) << "one warning per process";
  EXPECT_NE(recorder.messages[0].find(probe.reason), std::string::npos) << recorder.messages[0];
}

TEST(MakeCopyEngineTest, AutoPicksCudaOnlyWithADevice) {
  const bool cuda = CudaCopyEngine::compiledIn() && probeCudaDevices().deviceCount > 0;
  EXPECT_STREQ(makeCopyEngine(EngineChoice::kAuto)->name(), cuda ? "cuda" : "host");
  EXPECT_STREQ(makeCopyEngine()->name(), cuda ? "cuda" : "host");
  EXPECT_STREQ(makeCopyEngine(EngineChoice::kHost)->name(), "host");
}

// kCuda where it cannot work is an error that says why and what to use.
// The pipeline checks each chunk's sources after landing (check (b)) only
// where a copy's completion is on the host's timeline; CUDA's is not.
TEST(CopyEngineTest, OnlyHostSideEnginesCopyOnTheHostTimeline) {
  EXPECT_TRUE(HostCopyEngine().copiesOnHostTimeline());
  EXPECT_TRUE(makeCopyEngine(EngineChoice::kHost)->copiesOnHostTimeline());
  if (CudaCopyEngine::compiledIn() && probeCudaDevices().deviceCount > 0) {
    EXPECT_FALSE(makeCopyEngine(EngineChoice::kCuda)->copiesOnHostTimeline());
  }
}

TEST(MakeCopyEngineTest, CudaWithoutDeviceIsAClearError) {
  if (CudaCopyEngine::compiledIn() && probeCudaDevices().deviceCount > 0) {
    EXPECT_STREQ(makeCopyEngine(EngineChoice::kCuda)->name(), "cuda");
    return;
  }
  const std::string expected =
      CudaCopyEngine::compiledIn() ? "no usable CUDA device" : "built without CUDA";
  for (int attempt = 0; attempt < 2; ++attempt) {  // the probe is cached: same answer twice
    try {
      makeCopyEngine(EngineChoice::kCuda);
      FAIL() << "expected c10::Error";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("makeCopyEngine(kCuda)"), std::string::npos) << message;
      EXPECT_NE(message.find(expected), std::string::npos) << message;
      EXPECT_NE(message.find("kHost"), std::string::npos) << message;
    }
  }
}

// A build against a CUDA LibTorch (PyPI's torch) compiles the CUDA engine
// with c10's stream integration, device or not: CI compiles and links what
// the GPU machine runs.
TEST(CudaCopyEngineTest, CompiledInWithC10StreamsAgainstACudaLibTorch) {
#if defined(SHARDEMA_EXPECT_TORCH_CUDA_ENGINE)
  EXPECT_TRUE(CudaCopyEngine::compiledIn());
  EXPECT_TRUE(CudaCopyEngine::usesTorchStream());
#else
  GTEST_SKIP() << "this build has no CUDA toolkit or a CPU-only LibTorch";
#endif
}

// Building the CUDA engine directly fails cleanly too (no abort, no leak).
TEST(CudaCopyEngineTest, ConstructionFailsCleanlyWithoutDevice) {
  if (CudaCopyEngine::compiledIn() && probeCudaDevices().deviceCount > 0) {
    GTEST_SKIP() << "a CUDA device is present";
  }
  try {
    CudaCopyEngine engine;
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("CudaCopyEngine"), std::string::npos) << message;
  }
  EXPECT_FALSE(CudaCopyEngine::usesTorchStream() && !CudaCopyEngine::compiledIn());
}

}  // namespace
}  // namespace shardema::offload
