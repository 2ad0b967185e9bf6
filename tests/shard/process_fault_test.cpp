// Ranks as processes: the test binary re-launches itself once per rank
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment, the
// child test chosen with --gtest_filter). One rank dies in the middle of a
// gather; a rank never joins. The others must fail, naming the operation,
// within the short communicator timeout, not hang.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shardema/shard/communicator.h"
#include "shardema/shard/gather.h"
#include "support/temp_dir.h"

extern char** environ;

namespace shardema::shard {
namespace {

constexpr auto kTimeout = std::chrono::seconds(3);

struct Child {
  pid_t pid = -1;
  std::string log;
};

Child launch(const std::string& mode, int rank, int worldSize, int port, const std::string& dir) {
  Child child;
  child.log = dir + "/rank" + std::to_string(rank) + ".log";
  std::vector<std::string> env = {"SHARDEMA_FAULT_CHILD=" + mode, "RANK=" + std::to_string(rank),
                                  "WORLD_SIZE=" + std::to_string(worldSize),
                                  "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)};
  std::vector<char*> envp;
  for (auto& entry : env) envp.push_back(entry.data());
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=ProcessFaultTest.ChildRank";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, child.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  EXPECT_EQ(posix_spawn(&child.pid, "/proc/self/exe", &actions, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  return child;
}

// Waits for every child up to `deadline`, killing (by pid) any left over.
std::vector<int> waitAll(std::vector<Child>& children, std::chrono::seconds deadline) {
  std::vector<int> status(children.size(), -1);
  const auto end = std::chrono::steady_clock::now() + deadline;
  size_t left = children.size();
  while (left > 0 && std::chrono::steady_clock::now() < end) {
    for (size_t i = 0; i < children.size(); ++i) {
      int s = 0;
      if (status[i] == -1 && waitpid(children[i].pid, &s, WNOHANG) == children[i].pid) {
        status[i] = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < children.size(); ++i) {
    if (status[i] == -1) {
      kill(children[i].pid, SIGKILL);
      waitpid(children[i].pid, nullptr, 0);
      ADD_FAILURE() << "rank " << i << " still running after the deadline";
    }
  }
  return status;
}

std::string readLog(const Child& child) {
  std::ifstream in(child.log);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// In a child: the rank's work. Prints "CHILD-ERROR: <message>" and exits 0
// after a c10::Error; exits 1 if nothing failed. _Exit skips destructors:
// a group with a dead peer is not worth tearing down politely.
[[noreturn]] void childMain(const std::string& mode) {
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  CommunicatorOptions options;
  options.timeout = kTimeout;
  options.glooHostname = "127.0.0.1";
  try {
    Communicator comm = Communicator::fromEnvironment(options);
    ShardLayout layout;
    layout.specs.push_back(fsdp2Spec("block.weight", {4096, 16}, at::kFloat, comm.worldSize()));
    std::vector<at::Tensor> locals{at::ones({layout.specs[0].rangeOf(comm.rank()).size()})};
    GatherOptions gather;
    gather.root = -1;
    gather.bufferBytes = 4096;  // many rounds
    int64_t pieces = 0;
    gatherStreaming(
        comm, layout, locals,
        [&](const ShardSpec&, int64_t, const at::Tensor&) {
          if (mode == "die" && comm.rank() == 1 && ++pieces == 20) {
            std::_Exit(3);  // dies in the middle of the gather
          }
        },
        gather);
    std::printf("CHILD-OK\n");
    std::fflush(stdout);
    std::_Exit(1);
  } catch (const c10::Error& e) {
    std::printf("CHILD-ERROR: %s\nCHILD-SECONDS: %.3f\n", e.what_without_backtrace(), seconds());
    std::fflush(stdout);
    std::_Exit(0);
  }
}

TEST(ProcessFaultTest, ChildRank) {
  const char* mode = std::getenv("SHARDEMA_FAULT_CHILD");
  if (mode == nullptr) {
    GTEST_SKIP() << "runs only as a child of the other ProcessFaultTests";
  }
  childMain(mode);
}

TEST(ProcessFaultTest, RankDyingInAGatherFailsTheOthersWithinTheTimeout) {
  shardema::testing::TempDir dir;
  const int port = Communicator::freeLoopbackPort();
  const auto start = std::chrono::steady_clock::now();
  std::vector<Child> children;
  for (int rank = 0; rank < 3; ++rank) {
    children.push_back(launch("die", rank, 3, port, dir.path()));
  }
  const auto status = waitAll(children, std::chrono::seconds(40));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(status[1], 3) << readLog(children[1]);
  for (int rank : {0, 2}) {
    const std::string log = readLog(children[static_cast<size_t>(rank)]);
    EXPECT_EQ(status[static_cast<size_t>(rank)], 0) << log;
    EXPECT_NE(log.find("CHILD-ERROR: Communicator::"), std::string::npos) << log;
    EXPECT_NE(log.find("gatherStreaming 'block.weight'"), std::string::npos) << log;
    EXPECT_NE(log.find("on rank " + std::to_string(rank) + " of 3"), std::string::npos) << log;
  }
  EXPECT_LT(seconds, 20.0) << "the survivors must fail within about the 3 s timeout";
}

TEST(ProcessFaultTest, RankThatNeverJoinsTimesOutAtRendezvous) {
  shardema::testing::TempDir dir;
  const int port = Communicator::freeLoopbackPort();
  const auto start = std::chrono::steady_clock::now();
  std::vector<Child> children;
  for (int rank = 0; rank < 2; ++rank) {  // rank 2 of 3 never starts
    children.push_back(launch("gather", rank, 3, port, dir.path()));
  }
  const auto status = waitAll(children, std::chrono::seconds(40));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t rank = 0; rank < children.size(); ++rank) {
    const std::string log = readLog(children[rank]);
    EXPECT_EQ(status[rank], 0) << log;
    EXPECT_NE(log.find("CHILD-ERROR: Communicator rendezvous"), std::string::npos) << log;
    EXPECT_NE(log.find("rank " + std::to_string(rank) + " of 3"), std::string::npos) << log;
    // "At most this long" holds on every rank, the store's host included
    // (it used to wait the store's timeout and then the rendezvous's).
    const size_t at = log.find("CHILD-SECONDS: ");
    ASSERT_NE(at, std::string::npos) << log;
    const double waited = std::stod(log.substr(at + 15));
    const double timeout = std::chrono::duration<double>(kTimeout).count();
    // A joined rank may fail before its own deadline when the store's host
    // (started first) reaches its deadline and closes the store: that is
    // the host's timeout, not an early give-up, and says so.
    if (log.find("Connection reset by peer") == std::string::npos) {
      EXPECT_GE(waited, 0.9 * timeout) << "rank " << rank << " gave up early\n" << log;
    }
    EXPECT_LE(waited, timeout + 1.0) << "rank " << rank << " waited past its timeout\n" << log;
  }
  EXPECT_LT(seconds, 20.0);
}

}  // namespace
}  // namespace shardema::shard
