#include "demo_ranks.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "shardema/shard/communicator.h"

extern char** environ;

namespace shardema::demo {
namespace {

constexpr const char* kChildRankVariable = "SHARDEMA_DEMO_RANK";

void exportJob(int rank, int worldSize, int port) {
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(worldSize).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
}

// fork + exec rather than posix_spawn: the child must set its parent-death
// signal before exec, which posix_spawn cannot do.
pid_t spawnChild(int rank, const std::vector<std::string>& argv, const std::string& log) {
  std::vector<std::string> args = argv;
  std::vector<char*> raw;
  for (std::string& a : args) raw.push_back(a.data());
  raw.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("demo: fork failed for rank " + std::to_string(rank));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(3);  // the parent died before prctl
    setenv(kChildRankVariable, std::to_string(rank).c_str(), 1);
    setenv("RANK", std::to_string(rank).c_str(), 1);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv("/proc/self/exe", raw.data());
    _exit(127);
  }
  return pid;
}

}  // namespace

LocalRanks LocalRanks::start(int worldSize, const std::vector<std::string>& argv,
                             const std::string& logDir) {
  if (const char* childRank = std::getenv(kChildRankVariable)) {
    return LocalRanks(std::atoi(childRank), worldSize);
  }
  LocalRanks ranks(0, worldSize);
  exportJob(0, worldSize, worldSize > 1 ? shard::Communicator::freeLoopbackPort() : 29500);
  for (int r = 1; r < worldSize; ++r) {
    ranks.logs_.push_back(logDir + "/rank" + std::to_string(r) + ".log");
    ranks.children_.push_back(spawnChild(r, argv, ranks.logs_.back()));
  }
  return ranks;
}

LocalRanks::LocalRanks(LocalRanks&& other) noexcept
    : rank_(other.rank_),
      worldSize_(other.worldSize_),
      children_(std::move(other.children_)),
      logs_(std::move(other.logs_)) {
  other.children_.clear();
}

LocalRanks::~LocalRanks() {
  for (pid_t pid : children_) {
    if (pid > 0 && waitpid(pid, nullptr, WNOHANG) == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
}

// The children are polled together, so they are named in the order they
// ended: a rank killed by a signal is what broke the job, and the ranks that
// then exited with an error only lost their peer. Killed ones come first.
std::string LocalRanks::waitForChildren(std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> killed;
  std::vector<std::string> failed;
  size_t left = children_.size();
  while (left > 0) {
    const bool late = std::chrono::steady_clock::now() >= deadline;
    for (size_t i = 0; i < children_.size(); ++i) {
      if (children_[i] <= 0) continue;
      const std::string who = "rank " + std::to_string(i + 1) + " (log: " + logs_[i] + ")";
      int status = 0;
      const pid_t done = waitpid(children_[i], &status, WNOHANG);
      if (done == 0 || (done < 0 && errno == EINTR)) {
        if (!late) continue;
        kill(children_[i], SIGKILL);
        waitpid(children_[i], nullptr, 0);
        failed.push_back(who + " did not finish in time");
      } else if (done > 0 && WIFSIGNALED(status)) {
        killed.push_back(who + " was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
                         strsignal(WTERMSIG(status)) + ")");
      } else if (done > 0 && (!WIFEXITED(status) || WEXITSTATUS(status) != 0)) {
        failed.push_back(who + " exited with status " + std::to_string(WEXITSTATUS(status)));
      }
      children_[i] = -1;
      --left;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string failure;
  for (const std::string& part : killed) failure += (failure.empty() ? "" : "; then ") + part;
  for (const std::string& part : failed) failure += (failure.empty() ? "" : "; then ") + part;
  return failure;
}

}  // namespace shardema::demo
