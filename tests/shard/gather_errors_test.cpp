// Every rank of a gather fails together and promptly (no timeout) when the
// ranks disagree on the options or one rank brings an error of its own.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "shard/gather_fixture.h"
#include "shardema/shard/communicator.h"
#include "shardema/shard/gather.h"
#include "support/thread_ranks.h"
#include "support/value_error.h"

namespace shardema::shard {
namespace {

using namespace gather_fixture;  // NOLINT: test-local helpers
using shardema::testing::runThreadRanks;

// Runs `call` on every one of 3 thread ranks with a 20 s communicator
// timeout: each rank must throw c10::ValueError naming every substring of
// `expected`, well before the timeout, and the communicator stays usable
// (a normal gather follows).
void expectEveryRankFailsPromptly(const std::function<void(Communicator&)>& call,
                                  const std::vector<std::string>& expected) {
  const ShardLayout layout = makeLayout("fsdp2", 3);
  const auto full = fullTensors(layout, at::kFloat);
  shardema::testing::ThreadRanksOptions ranks;
  ranks.timeout = std::chrono::seconds(20);
  runThreadRanks(
      3,
      [&](Communicator& comm) {
        const auto start = std::chrono::steady_clock::now();
        const std::string message = shardema::testing::valueErrorMessage([&] { call(comm); });
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5))
            << "rank " << comm.rank() << ": " << message;
        for (const std::string& part : expected) {
          EXPECT_NE(message.find(part), std::string::npos)
              << "rank " << comm.rank() << ": '" << message << "' should name '" << part << "'";
        }
        EXPECT_FALSE(comm.broken());
        GatherOptions all;
        all.root = -1;
        expectSame(full, gatherFull(comm, layout, localsOf(layout, full, comm.rank()), all), layout,
                   "after the failure");
      },
      ranks);
}

TEST(GatherTest, MismatchedBufferBytesFailsEveryRankPromptly) {
  const ShardLayout layout = makeLayout("fsdp2", 3);
  const auto full = fullTensors(layout, at::kFloat);
  expectEveryRankFailsPromptly(
      [&](Communicator& comm) {
        GatherOptions options;
        options.bufferBytes = comm.rank() == 2 ? 4096 : 1024;
        gatherFull(comm, layout, localsOf(layout, full, comm.rank()), options);
      },
      {"options.bufferBytes is ", "4096", "1024", "rank 2"});
  expectEveryRankFailsPromptly(
      [&](Communicator& comm) {
        GatherOptions options;
        options.bufferBytes = comm.rank() == 0 ? 100 : 64;
        scatterFull(comm, layout, comm.rank() == 0 ? full : std::vector<at::Tensor>{}, options);
      },
      {"scatterFull: options.bufferBytes is ", "100", "64", "rank 0"});
}

TEST(GatherTest, MismatchedRootFailsEveryRankPromptly) {
  const ShardLayout layout = makeLayout("fsdp2", 3);
  const auto full = fullTensors(layout, at::kFloat);
  expectEveryRankFailsPromptly(
      [&](Communicator& comm) {
        GatherOptions options;
        options.root = comm.rank() == 1 ? -1 : 0;  // a broadcast against an all-to-all
        gatherStreaming(
            comm, layout, localsOf(layout, full, comm.rank()),
            [](const ShardSpec&, int64_t, const at::Tensor&) {}, options);
      },
      {"gatherStreaming: root is ", "-1", "0 on rank", "rank 1"});
  expectEveryRankFailsPromptly(
      [&](Communicator& comm) {
        GatherOptions options;
        options.root = comm.rank() == 2 ? 2 : 1;
        scatterFull(comm, layout, comm.rank() == options.root ? full : std::vector<at::Tensor>{},
                    options);
      },
      {"scatterFull: root is ", "2", "1 on rank", "rank 2"});
}

TEST(GatherTest, LocalErrorFailsEveryRankPromptly) {
  const ShardLayout layout = makeLayout("fsdp2", 3);
  const auto full = fullTensors(layout, at::kFloat);
  for (int64_t root : {int64_t{0}, int64_t{-1}}) {
    expectEveryRankFailsPromptly(
        [&](Communicator& comm) {
          GatherOptions options;
          options.root = root;
          options.localError = comm.rank() == 1 ? "wait() failed: disk full" : "";
          // The failing rank has no data: its locals are not looked at.
          gatherFull(
              comm, layout,
              comm.rank() == 1 ? std::vector<at::Tensor>{} : localsOf(layout, full, comm.rank()),
              options);
        },
        {"rank 1: wait() failed: disk full", "no data was moved"});
  }
  // Two ranks fail: both reasons reach every rank.
  expectEveryRankFailsPromptly(
      [&](Communicator& comm) {
        GatherOptions options;
        options.localError = comm.rank() == 1 ? "first reason" : "";
        std::vector<at::Tensor> locals = localsOf(layout, full, comm.rank());
        if (comm.rank() == 2) {
          locals.pop_back();  // a validation failure of its own
        }
        gatherFull(comm, layout, locals, options);
      },
      {"rank 1: first reason", "rank 2: gatherStreaming: rank 2 passed"});
  expectEveryRankFailsPromptly(
      [&](Communicator& comm) {
        GatherOptions options;
        options.localError = comm.rank() == 0 ? "root lost its file" : "";
        scatterFull(comm, layout, {}, options);
      },
      {"rank 0: root lost its file"});
}
}  // namespace
}  // namespace shardema::shard
