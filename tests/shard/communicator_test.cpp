// Communicator over Gloo with thread ranks: every collective moves the
// bytes it should (values encode sender and index), bf16 travels as bytes,
// errors name the operation, and a failed group stays failed.
#include "shardema/shard/communicator.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "support/thread_ranks.h"
#include "support/value_error.h"

namespace shardema::shard {
namespace {

using shardema::testing::runThreadRanks;

// Rank r's i-th value: r * 1000 + i (exact in fp32 and in int16 bits).
at::Tensor encoded(int64_t rank, int64_t count) {
  return at::arange(count, at::kFloat) + static_cast<float>(rank * 1000);
}

TEST(CommunicatorTest, CollectivesMoveWhatTheyShould) {
  for (int64_t worldSize = 1; worldSize <= 4; ++worldSize) {
    runThreadRanks(worldSize, [worldSize](Communicator& comm) {
      const int64_t me = comm.rank();
      ASSERT_EQ(comm.worldSize(), worldSize);
      at::Tensor all = at::empty({5 * worldSize}, at::kFloat);
      comm.allGather(encoded(me, 5), all, "allGather test");
      at::Tensor root = at::empty({5 * worldSize}, at::kFloat);
      comm.gather(encoded(me, 5), root, worldSize - 1, "gather test");
      for (int64_t r = 0; r < worldSize; ++r) {
        EXPECT_TRUE(at::equal(all.narrow(0, 5 * r, 5), encoded(r, 5))) << "rank " << me;
        if (me == worldSize - 1) {
          EXPECT_TRUE(at::equal(root.narrow(0, 5 * r, 5), encoded(r, 5)));
        }
      }
      // bf16 broadcast is refused by Gloo itself; ours moves bytes.
      at::Tensor half = me == 0 ? encoded(7, 9).to(at::kBFloat16) : at::zeros({9}, at::kBFloat16);
      comm.broadcast(half, 0, "broadcast test");
      EXPECT_TRUE(at::equal(half, encoded(7, 9).to(at::kBFloat16))) << "rank " << me;
      // Uneven all-to-all: rank r sends r + q + 1 floats to rank q.
      std::vector<int64_t> inSplits, outSplits;
      std::vector<at::Tensor> sends;
      for (int64_t q = 0; q < worldSize; ++q) {
        inSplits.push_back((me + q + 1) * 4);
        outSplits.push_back((q + me + 1) * 4);
        sends.push_back(encoded(me * 10 + q, me + q + 1));
      }
      at::Tensor out = at::empty({at::cat(sends).numel() + 0}, at::kFloat);
      int64_t outCount = 0;
      for (int64_t q = 0; q < worldSize; ++q) outCount += q + me + 1;
      out = at::empty({outCount}, at::kFloat);
      comm.allToAll(at::cat(sends), out, inSplits, outSplits, "allToAll test");
      int64_t offset = 0;
      for (int64_t q = 0; q < worldSize; ++q) {
        EXPECT_TRUE(at::equal(out.narrow(0, offset, q + me + 1), encoded(q * 10 + me, q + me + 1)))
            << "rank " << me << " from " << q;
        offset += q + me + 1;
      }
      comm.barrier("barrier test");
      EXPECT_FALSE(comm.broken());
    });
  }
}

// Data-parallel gradients: every rank ends with the elementwise sum, which
// for small integers is exact, so it is compared with equality.
TEST(CommunicatorTest, AllReduceSumAddsEveryRanksValues) {
  for (int64_t worldSize = 1; worldSize <= 3; ++worldSize) {
    runThreadRanks(worldSize, [worldSize](Communicator& comm) {
      at::Tensor grads = encoded(comm.rank(), 6).view({2, 3});
      comm.allReduceSum(grads, "allReduceSum test");
      at::Tensor expected = at::zeros({6}, at::kDouble);
      for (int64_t r = 0; r < worldSize; ++r) expected += encoded(r, 6).to(at::kDouble);
      EXPECT_TRUE(at::equal(grads.reshape({-1}).to(at::kDouble), expected)) << comm.rank();
      at::Tensor wide = at::full({4}, 0.25 * (comm.rank() + 1), at::kDouble);
      comm.allReduceSum(wide, "allReduceSum float64");
      EXPECT_DOUBLE_EQ(wide[3].item<double>(), 0.125 * worldSize * (worldSize + 1));
      EXPECT_VALUE_ERROR(comm.allReduceSum(at::zeros({2}, at::kInt), "ints"), "float32 or float64");
      EXPECT_FALSE(comm.broken());
    });
  }
}

TEST(CommunicatorTest, BadArgumentsAreValueErrorsThatMoveNothing) {
  runThreadRanks(2, [](Communicator& comm) {
    EXPECT_VALUE_ERROR(comm.allGather(at::zeros({3}), at::zeros({5}), "w"), "output must hold 24");
    EXPECT_VALUE_ERROR(comm.broadcast(at::zeros({3}), 2, "w"), "root must be in [0, 2)");
    EXPECT_VALUE_ERROR(comm.allToAll(at::zeros({2}), at::zeros({2}), {4, 8}, {4, 4}, "w"),
                       "inputSplits sum to 12");
    EXPECT_VALUE_ERROR(comm.broadcast(at::zeros({4, 4}).t(), 0, "w"), "contiguous");
    EXPECT_FALSE(comm.broken());  // nothing was sent: still usable
    comm.barrier("after bad arguments");
  });
}

TEST(CommunicatorTest, TimeoutNamesTheOperationAndBreaksTheCommunicator) {
  // (Ranks that disagree on a size are not a test case: Gloo's transport
  // aborts the whole process then, which is why gather/scatter agree on the
  // layout with a fixed-size header before moving data.)
  shardema::testing::ThreadRanksOptions options;
  options.timeout = std::chrono::seconds(2);
  const auto start = std::chrono::steady_clock::now();
  runThreadRanks(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 1) {
          // Never joins the all-gather; stays alive past rank 0's timeout.
          std::this_thread::sleep_for(std::chrono::seconds(4));
          return;
        }
        std::string message;
        try {
          comm.allGather(at::zeros({4}), at::zeros({8}), "tensor 'w.weight'");
        } catch (const c10::Error& e) {
          message = e.what_without_backtrace();
        }
        EXPECT_NE(message.find("Communicator::allGather of 'tensor 'w.weight''"), std::string::npos)
            << message;
        EXPECT_NE(message.find("rank 0 of 2"), std::string::npos) << message;
        EXPECT_TRUE(comm.broken());
        try {
          comm.barrier("later");
          ADD_FAILURE() << "a broken communicator must refuse";
        } catch (const c10::Error& e) {
          const std::string later = e.what_without_backtrace();
          EXPECT_NE(later.find("broken since an earlier failure"), std::string::npos) << later;
          EXPECT_NE(later.find("w.weight"), std::string::npos) << later;
        }
      },
      options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// PyPI's torch is a CUDA build, so NCCL is compiled in; without a device
// (CI) it refuses at once, naming what is missing, before any rendezvous.
// Where a device is (bench/gpu/run.sh) a one-rank NCCL group is made.
TEST(CommunicatorTest, NcclWithoutDeviceRefusesNamingWhy) {
  CommunicatorOptions options;
  options.backend = CommBackend::kNccl;
  options.timeout = std::chrono::seconds(30);
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto start = std::chrono::steady_clock::now();
  if (torch::cuda::device_count() > 0) {
    Communicator comm(store, 0, 1, options);
    EXPECT_EQ(comm.worldSize(), 1);
    return;
  }
  try {
    Communicator comm(store, 0, 1, options);
    ADD_FAILURE() << "NCCL without a CUDA device must refuse";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("kNccl on rank 0 of 1 needs a CUDA device"), std::string::npos)
        << message;
    EXPECT_NE(message.find("use CommBackend::kGloo"), std::string::npos) << message;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(CommunicatorTest, EnvironmentErrorsNameTheVariable) {
  const auto withEnv = [](const char* addr, const char* port, const char* rank, const char* world) {
    const auto put = [](const char* name, const char* value) {
      value ? setenv(name, value, 1) : unsetenv(name);
    };
    put("MASTER_ADDR", addr);
    put("MASTER_PORT", port);
    put("RANK", rank);
    put("WORLD_SIZE", world);
    return [] { Communicator::fromEnvironment(); };
  };
  EXPECT_VALUE_ERROR(withEnv(nullptr, "1234", "0", "1")(), "MASTER_ADDR is not set");
  EXPECT_VALUE_ERROR(withEnv("127.0.0.1", "70000", "0", "1")(), "MASTER_PORT='70000'");
  EXPECT_VALUE_ERROR(withEnv("127.0.0.1", "1234", "0", "two")(), "WORLD_SIZE='two'");
  EXPECT_VALUE_ERROR(withEnv("127.0.0.1", "1234", "2", "2")(), "RANK='2'");
  EXPECT_VALUE_ERROR(withEnv("127.0.0.1", "1234", nullptr, "2")(), "RANK is not set");
  CommunicatorOptions zero;
  zero.timeout = std::chrono::milliseconds(0);
  withEnv("127.0.0.1", "1234", "0", "1");
  EXPECT_VALUE_ERROR(Communicator::fromEnvironment(zero), "timeout must be positive");
}

// A port outgoing connections can take (the ephemeral range) would let any
// test beside this one take a picked port before its job binds it.
TEST(CommunicatorTest, FreeLoopbackPortsLieBelowTheEphemeralRangeAndServeAStore) {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 32768, high = 60999;
  range >> low >> high;
  std::set<int> seen;
  for (int i = 0; i < 8; ++i) {
    const int port = Communicator::freeLoopbackPort();
    EXPECT_GT(port, 1024);
    EXPECT_LT(port, low);
    seen.insert(port);
  }
  EXPECT_GT(seen.size(), 1u);  // drawn at random, not one fixed port
  const int port = Communicator::freeLoopbackPort();
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  Communicator comm = Communicator::fromEnvironment();
  EXPECT_EQ(comm.worldSize(), 1);
}

}  // namespace
}  // namespace shardema::shard
