#pragma once
// runThreadRanks(W, body): W ranks as threads of this process, each with
// its own shardema::shard::Communicator (Gloo over loopback) on one shared
// c10d::HashStore, as gloo's and c10d's own tests do. Rethrows the first
// error a rank raised (its original type), after every rank has returned.
// A deadline guards the test binary: ranks that are still running after it
// make the process abort with a message rather than hang ctest.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "shardema/shard/communicator.h"

namespace shardema::testing {

// torch 2.11's c10d flight recorder adds each process group to a std::map
// before it takes its mutex (FlightRecorder::recordWithResetEnabled in
// torch/csrc/distributed/c10d/FlightRecorderDetail.hpp), so the first
// collectives of two ranks on two threads of one process race there: seen
// as a crash in std::_Rb_tree_insert_and_rebalance about once in 20 runs of
// CommunicatorTest. A real job has one rank per process and never does.
// Thread ranks turn the recorder off (TORCH_FR_BUFFER_SIZE=0), which torch
// reads once, when the first group of the process is made: hence at
// program start, in every test binary that includes this header.
inline const bool kFlightRecorderOffForThreadRanks = setenv("TORCH_FR_BUFFER_SIZE", "0", 1) == 0;

struct ThreadRanksOptions {
  /// Communicator timeout of every rank. Default 20 s: a broken test fails
  /// well inside ctest's limit.
  std::chrono::milliseconds timeout = std::chrono::seconds(20);
  /// Abort the process when the ranks have not all returned by then.
  /// Default 120 s.
  std::chrono::milliseconds deadline = std::chrono::seconds(120);
};

inline shard::CommunicatorOptions threadRankCommOptions(const ThreadRanksOptions& options) {
  shard::CommunicatorOptions comm;
  comm.timeout = options.timeout;
  comm.glooHostname = "127.0.0.1";
  return comm;
}

inline void runThreadRanks(int64_t worldSize, const std::function<void(shard::Communicator&)>& body,
                           const ThreadRanksOptions& options = {}) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::condition_variable done;
  int64_t finished = 0;
  std::exception_ptr firstError;
  std::vector<std::thread> ranks;
  for (int64_t rank = 0; rank < worldSize; ++rank) {
    ranks.emplace_back([&, rank] {
      std::exception_ptr error;
      try {
        shard::Communicator comm(store, rank, worldSize, threadRankCommOptions(options));
        body(comm);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (error && !firstError) {
        firstError = error;
      }
      ++finished;
      done.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (!done.wait_for(lock, options.deadline, [&] { return finished == worldSize; })) {
      std::fprintf(stderr, "runThreadRanks: %lld of %lld ranks still running after %lld ms\n",
                   static_cast<long long>(worldSize - finished), static_cast<long long>(worldSize),
                   static_cast<long long>(options.deadline.count()));
      std::abort();
    }
  }
  for (auto& rank : ranks) {
    rank.join();
  }
  if (firstError) {
    std::rethrow_exception(firstError);
  }
}

}  // namespace shardema::testing
