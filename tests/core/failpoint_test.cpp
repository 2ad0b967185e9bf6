// Failpoints: unarmed they never fire; armed they fire where their
// predicate holds, on any thread, at most once when asked; only the names
// failpoint.h lists can be armed, one Armed per name at a time.
#include "shardema/core/failpoint.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace shardema {
namespace {

constexpr const char* kChunk = "offload.pipeline.chunk";

TEST(FailpointTest, UnarmedNeverFires) {
  EXPECT_FALSE(failpoint::fires(kChunk, 3, 2));
  EXPECT_FALSE(failpoint::fires("no.such.failpoint"));
}

TEST(FailpointTest, ArmedFiresWhereItsPredicateHoldsUntilDisarmed) {
  {
    failpoint::Armed armed(kChunk,
                           [](int64_t step, int64_t chunk) { return step == 3 && chunk == 2; });
    EXPECT_FALSE(failpoint::fires(kChunk, 3, 1));
    EXPECT_TRUE(failpoint::fires(kChunk, 3, 2));
    EXPECT_TRUE(failpoint::fires(kChunk, 3, 2));
    EXPECT_FALSE(failpoint::fires("lib.ema_storage.allocate", 3, 2)) << "another name";
    EXPECT_EQ(armed.fired(), 2);
  }
  EXPECT_FALSE(failpoint::fires(kChunk, 3, 2));
}

TEST(FailpointTest, OnceFiresOnce) {
  failpoint::Armed armed(
      "lib.ema_storage.allocate", [](int64_t, int64_t) { return true; },
      /*once=*/true);
  EXPECT_TRUE(failpoint::fires("lib.ema_storage.allocate", 0));
  EXPECT_FALSE(failpoint::fires("lib.ema_storage.allocate", 0));
  EXPECT_EQ(armed.fired(), 1);
}

TEST(FailpointTest, UnknownNamesAndSecondArmsAreRefused) {
  EXPECT_THROW(failpoint::Armed("offload.pipeline.chunks", [](int64_t, int64_t) { return true; }),
               c10::ValueError);
  failpoint::Armed armed(kChunk, [](int64_t, int64_t) { return false; });
  EXPECT_THROW(failpoint::Armed(kChunk, [](int64_t, int64_t) { return true; }), c10::ValueError);
  EXPECT_THROW(failpoint::Armed("offload.pipeline.stage_host_source", nullptr), c10::ValueError);
}

// Workers of a pool pass failpoints: every thread sees an arm made before
// they start, and counts are exact.
TEST(FailpointTest, EveryThreadSeesTheArm) {
  failpoint::Armed armed(kChunk, [](int64_t, int64_t chunk) { return chunk % 2 == 0; });
  std::atomic<int> fired{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int chunk = 0; chunk < 100; ++chunk) fired += failpoint::fires(kChunk, t, chunk);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(fired.load(), 4 * 50);
  EXPECT_EQ(armed.fired(), 4 * 50);
}

}  // namespace
}  // namespace shardema
