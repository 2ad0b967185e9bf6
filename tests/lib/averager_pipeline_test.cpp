// Averager storages: kPinnedHost (asynchronous pipeline) against kDevice
// (synchronous ATen) on CPU tensors, bit for bit; a failure on a worker
// marks the Averager failed until a saved state is loaded. Runs under TSan.
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "shardema/averager.h"
#include "shardema/core/failpoint.h"
#include "shardema/offload/worker_pool.h"
#include "support/same_bytes.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

#if defined(__SANITIZE_THREAD__)
constexpr int64_t kSteps = 60;  // TSan: every hand-off is 10-50x slower
#else
constexpr int64_t kSteps = 300;
#endif

// Sources of mixed dtypes and roles, sizes 0 to a few chunks.
std::vector<TrackedTensor> makeSources() {
  std::vector<TrackedTensor> out;
  const int64_t sizes[] = {0, 1, 33, 300, 1000};
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  int i = 0;
  for (int64_t n : sizes) {
    for (at::ScalarType dtype : dtypes) {
      at::Tensor t = at::zeros({n}, dtype);
      const TrackRole role = i % 4 == 3 ? TrackRole::kAverageIfTrainable : TrackRole::kAverage;
      out.push_back({"p" + std::to_string(i++), t, role});
    }
  }
  out.push_back({"frozen", at::zeros({50}), TrackRole::kAverageIfTrainable});  // no grad: copied
  out.push_back({"counter", at::zeros({3}, at::kLong), TrackRole::kCopy});
  out.push_back({"once", at::zeros({2}), TrackRole::kCopyOnce});
  for (TrackedTensor& t : out) {
    if (t.role == TrackRole::kAverageIfTrainable && t.name != "frozen") t.source.requires_grad_();
  }
  return out;
}

// The same values into both models' sources: a pure function of step/index.
void setSources(std::vector<TrackedTensor>& sources, int64_t step) {
  for (size_t k = 0; k < sources.size(); ++k) {
    at::Tensor fp32 = at::empty({sources[k].source.numel()}, at::kFloat);
    float* p = fp32.data_ptr<float>();
    for (int64_t i = 0; i < fp32.numel(); ++i) {
      p[i] = static_cast<float>(std::sin(0.1 * step + 0.37 * (i + 1) * (k + 1)) * 3 + 0.01 * step);
      if (sources[k].role == TrackRole::kCopy) p[i] = std::floor(p[i] * 100);
    }
    sources[k].source.detach().copy_(fp32);
  }
}

void poison(std::vector<TrackedTensor>& sources) {
  for (TrackedTensor& t : sources) {
    if (t.source.is_floating_point()) {
      t.source.detach().fill_(std::numeric_limits<float>::quiet_NaN());
    } else {
      t.source.detach().fill_(-7);
    }
  }
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.nbytes() == b.nbytes() &&
         testing::sameBytes(a.data_ptr(), b.data_ptr(), a.nbytes());
}

std::vector<TrackedTensor> cloneSources(const std::vector<TrackedTensor>& sources) {
  std::vector<TrackedTensor> out;
  for (const TrackedTensor& t : sources) {
    out.push_back(
        {t.name, t.source.detach().clone().requires_grad_(t.source.requires_grad()), t.role});
  }
  return out;
}

TEST(AveragerPipelineTest, PinnedHostEqualsDeviceBitForBitWithDeferredFence) {
  offload::WorkerPool pool(2);
  std::vector<TrackedTensor> hostSources = makeSources();
  std::vector<TrackedTensor> deviceSources = cloneSources(hostSources);
  AveragerOptions hostOptions;
  hostOptions.pool = &pool;
  hostOptions.offload.chunkBytes = 512;  // many chunks, several tensors per chunk
  hostOptions.offload.numSlots = 3;
  hostOptions.offload.engine = offload::EngineChoice::kHost;
  AveragerOptions deviceOptions;
  deviceOptions.storage = EmaStorage::kDevice;
  Averager host(hostSources, hostOptions);
  Averager device(deviceSources, deviceOptions);
  EXPECT_EQ(host.storage(), EmaStorage::kPinnedHost);
  for (int64_t step = 1; step <= kSteps; ++step) {
    setSources(hostSources, step);
    setSources(deviceSources, step);
    EXPECT_TRUE(host.update(step));
    EXPECT_TRUE(device.update(step));
    host.fence();
    poison(hostSources);  // the next optimizer step; the math may still run
    if (step % 100 == 0 || step == kSteps) {
      const auto a = host.emaTensors();  // waits
      const auto b = device.emaTensors();
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_TRUE(sameBytes(a[i].second, b[i].second)) << a[i].first << " step " << step;
      }
    }
  }
  EXPECT_EQ(host.offloadStats().stagingBytes, 0) << "host sources are read in place, unstaged";
  EXPECT_EQ(host.offloadStats().updates, kSteps);
  EXPECT_EQ(device.offloadStats().stagingBytes, 0);
}

TEST(AveragerPipelineTest, AWorkerFailureMarksTheAveragerFailedUntilAStateIsLoaded) {
  testing::TempDir dir;
  offload::WorkerPool pool(2);
  at::Tensor a = at::zeros({100});
  at::Tensor b = at::zeros({100});
  AveragerOptions options;
  options.pool = &pool;
  options.offload.chunkBytes = 128;
  Averager averager({{"enc.a", a, TrackRole::kAverage}, {"enc.b", b, TrackRole::kAverage}},
                    options);
  failpoint::Armed fault("offload.pipeline.chunk",
                         [](int64_t step, int64_t chunk) { return step == 3 && chunk == 2; });
  Averager reference(
      {{"enc.a", a.clone(), TrackRole::kAverage}, {"enc.b", b.clone(), TrackRole::kAverage}},
      AveragerOptions{});
  for (int64_t step = 1; step <= 2; ++step) {
    a.fill_(static_cast<float>(step));
    b.fill_(static_cast<float>(-step));
    averager.update(step);
    averager.fence();
  }
  averager.save(dir.file("good.safetensors"));
  a.fill_(3.0f);
  EXPECT_TRUE(averager.update(3));  // returns: the failure is on a worker
  auto expectFailed = [](const std::function<void()>& call, const std::string& what) {
    try {
      call();
      ADD_FAILURE() << what << " did not throw";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("step 3"), std::string::npos) << what << ": " << message;
      EXPECT_NE(message.find("'enc.a'"), std::string::npos) << what << ": " << message;
      EXPECT_NE(message.find("failed"), std::string::npos) << what << ": " << message;
    }
  };
  expectFailed([&] { averager.wait(); }, "wait");
  EXPECT_TRUE(averager.failed());
  expectFailed([&] { averager.ema("enc.a"); }, "ema");
  expectFailed([&] { averager.emaTensors(); }, "emaTensors");
  expectFailed([&] { averager.state(); }, "state");
  expectFailed([&] { averager.update(4); }, "update");
  expectFailed([&] { averager.copyTo(); }, "copyTo");
  expectFailed([&] { averager.fence(); }, "fence");  // like every other call
  averager.load(dir.file("good.safetensors"));
  EXPECT_FALSE(averager.failed());
  EXPECT_EQ(averager.step(), 2);
  // Back in business: continues exactly like an Averager that never failed.
  for (int64_t step : {1, 2, 4}) {
    reference.tracked()[0].source.fill_(step == 4 ? 4.0f : static_cast<float>(step));
    reference.tracked()[1].source.fill_(step == 4 ? -4.0f : static_cast<float>(-step));
    reference.update(step);
    reference.fence();
  }
  a.fill_(4.0f);
  b.fill_(-4.0f);
  EXPECT_TRUE(averager.update(4));
  for (const char* name : {"enc.a", "enc.b"}) {
    EXPECT_TRUE(sameBytes(averager.ema(name), reference.ema(name))) << name;
  }
}

// The destructor waits for an update in flight (no use after free under
// TSan/ASan), and a moved Averager keeps working.
TEST(AveragerPipelineTest, DestructorAndMoveWaitForTheUpdateInFlight) {
  at::Tensor a = at::ones({5000});
  AveragerOptions options;
  options.offload.chunkBytes = 256;
  for (int round = 0; round < 20; ++round) {
    Averager averager({{"a", a, TrackRole::kAverage}}, options);
    averager.update(1);
    averager.fence();
    if (round % 2 == 0) {
      Averager moved(std::move(averager));
      moved.update(2);
      moved.fence();
      Averager other({{"a", a, TrackRole::kAverage}}, options);
      other.update(1);
      other = std::move(moved);  // retires other's update in flight first
      EXPECT_EQ(other.step(), 2);
    }
  }
}

}  // namespace
}  // namespace shardema
