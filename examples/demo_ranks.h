#pragma once
// The demo's local job: the process the user starts is rank 0; it spawns
// ranks 1..W-1 as copies of itself (same arguments) and every rank then
// joins one c10d group over loopback (Communicator::fromEnvironment), as a
// torchrun job on one host would.
#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace shardema::demo {

class LocalRanks {
 public:
  /// In a child (the environment says so) reads its rank; in the first
  /// process picks a free loopback port, exports RANK, WORLD_SIZE,
  /// MASTER_ADDR and MASTER_PORT for itself and starts the children with
  /// `argv`, each writing its output to {logDir}/rank{r}.log. Children die
  /// with the parent (PR_SET_PDEATHSIG), so a failed demo leaves none behind.
  static LocalRanks start(int worldSize, const std::vector<std::string>& argv,
                          const std::string& logDir);
  LocalRanks(LocalRanks&&) noexcept;
  LocalRanks& operator=(LocalRanks&&) = delete;
  LocalRanks(const LocalRanks&) = delete;
  ~LocalRanks();

  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }

  /// Rank 0: waits up to `timeout` for every child; "" when all exited 0,
  /// else one line naming the ranks that failed and their log files: those
  /// killed by a signal first (the cause), then those that exited with an
  /// error (usually because they lost that peer).
  std::string waitForChildren(std::chrono::seconds timeout);

 private:
  LocalRanks(int rank, int worldSize) : rank_(rank), worldSize_(worldSize) {}
  int rank_ = 0;
  int worldSize_ = 1;
  std::vector<pid_t> children_;
  std::vector<std::string> logs_;
};

}  // namespace shardema::demo
