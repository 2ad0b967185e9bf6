// Crash test: a child process saves in a loop (Averager::save of one file;
// a 2-rank sharded checkpoint with its manifest) and is SIGKILLed at random
// points, 20 times per kind. After every kill the newest checkpoint loads
// and equals a completed save (the one the child last reported, or the one
// it was finishing), no partial file is taken for it, and the next completed
// save leaves no leftover (.tmp, orphaned rank files) behind.
//
// The child is a fork() of this test: the EMA lives on the device (kDevice,
// no pipeline threads) and ATen runs on one thread, so the child needs no
// thread its parent had.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "shardema/averager.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

namespace fs = std::filesystem;

constexpr int kKillsPerKind = 20;

// About 1.5 MiB of state, so a save takes long enough (writes, two fsyncs)
// for the kills to land inside it.
std::vector<TrackedTensor> model() {
  return {{"enc.weight", at::zeros({384, 512})},
          {"enc.bias", at::zeros({384})},
          {"steps", at::zeros({1}, at::kLong), TrackRole::kCopy}};
}

// What every tensor holds after update(step): decay 0 makes the EMA an
// exact copy, so a loaded state must be exactly this function of its step.
void setSources(const std::vector<TrackedTensor>& tracked, int64_t step) {
  tracked[0].source.copy_(at::arange(384 * 512, at::kFloat).reshape({384, 512}) + step);
  tracked[1].source.fill_(static_cast<double>(-step));
  tracked[2].source.fill_(step);
}

AveragerOptions copyingOptions() {
  AveragerOptions options;
  options.schedule = DecaySchedule::constant({0.0});
  options.storage = EmaStorage::kDevice;
  return options;
}

// Saves step 1, 2, ... until killed, writing each completed step to `out`.
[[noreturn]] void saveForever(const std::function<void(int64_t)>& saveAt, int out) {
  for (int64_t step = 1;; ++step) {
    saveAt(step);
    if (::write(out, &step, sizeof step) != sizeof step) ::_exit(3);
  }
}

// Forks a child running `saveAt` in a loop, kills it at a random moment
// after its first completed save, and returns the last step it reported.
int64_t saveAndKill(const std::function<void(int64_t)>& saveAt, std::mt19937& random) {
  int pipeFds[2];
  EXPECT_EQ(::pipe(pipeFds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pipeFds[0]);
    try {
      saveForever(saveAt, pipeFds[1]);
    } catch (...) {
      ::_exit(2);
    }
  }
  ::close(pipeFds[1]);
  int64_t reported = 0;
  EXPECT_EQ(::read(pipeFds[0], &reported, sizeof reported), sizeof reported)
      << "the child never completed a save";
  std::this_thread::sleep_for(
      std::chrono::microseconds(std::uniform_int_distribution<int>(0, 40000)(random)));
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status)) << "the child stopped before the kill, status " << status;
  for (int64_t step = 0; ::read(pipeFds[0], &step, sizeof step) == sizeof step;) reported = step;
  ::close(pipeFds[0]);
  return reported;
}

void expectStateOfStep(const Averager& loaded, int64_t step) {
  std::vector<TrackedTensor> expected = model();
  setSources(expected, step);
  for (const TrackedTensor& t : expected) {
    EXPECT_TRUE(loaded.ema(t.name).equal(t.source)) << t.name << " at step " << step;
  }
}

std::set<std::string> filesIn(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  return names;
}

// Whether the kill left a write behind: evidence that it landed in a save.
bool hasTmp(const std::string& dir) {
  for (const std::string& name : filesIn(dir)) {
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) return true;
  }
  return false;
}

class CrashTest : public ::testing::Test {
 protected:
  void SetUp() override { at::set_num_threads(1); }
  std::mt19937 random_{20261203};
};

TEST_F(CrashTest, KilledSingleFileSavesLeaveTheLastCompletedOne) {
  testing::TempDir dir;
  const std::string path = dir.file("ema.safetensors");
  std::vector<TrackedTensor> tracked = model();
  Averager averager(tracked, copyingOptions());
  const auto saveAt = [&](int64_t step) {
    setSources(tracked, step);
    averager.update(step);
    averager.save(path);
  };
  int midSave = 0;
  for (int kill = 0; kill < kKillsPerKind; ++kill) {
    SCOPED_TRACE("kill " + std::to_string(kill));
    const int64_t reported = saveAndKill(saveAt, random_);
    midSave += hasTmp(dir.path());
    Averager loaded(model(), copyingOptions());
    loaded.load(path);
    // The save after the last report may have completed its rename before
    // the kill; nothing else may be found.
    EXPECT_TRUE(loaded.step() == reported || loaded.step() == reported + 1)
        << "loaded step " << loaded.step() << ", last reported " << reported;
    expectStateOfStep(loaded, loaded.step());
  }
  std::printf("%d of %d kills left a .tmp (landed in a write)\n", midSave, kKillsPerKind);
  saveAt(averager.step() + 1);  // a completed save in the same folder
  EXPECT_EQ(filesIn(dir.path()), std::set<std::string>{"ema.safetensors"})
      << "the next save replaces the leftover .tmp";
}

TEST_F(CrashTest, KilledShardedSavesLeaveTheLastCompletedCheckpoint) {
  testing::TempDir dir;
  const std::string folder = dir.file("ckpt");
  std::vector<TrackedTensor> tracked = model();
  std::vector<std::unique_ptr<ShardedAverager>> ranks;
  for (int64_t r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<ShardedAverager>(
        r, 2, shardsFromFullTensors(tracked, shard::LayoutKind::kFsdp2, r, 2), copyingOptions()));
  }
  const auto saveAt = [&](int64_t step) {
    setSources(tracked, step);
    for (auto& rank : ranks) rank->update(step);
    saveCheckpoint(folder, {ranks[0].get(), ranks[1].get()});
  };
  int midSave = 0;
  for (int kill = 0; kill < kKillsPerKind; ++kill) {
    SCOPED_TRACE("kill " + std::to_string(kill));
    const int64_t reported = saveAndKill(saveAt, random_);
    midSave += hasTmp(folder);
    std::vector<TrackedTensor> expected = model();
    int64_t step = -1;
    for (int64_t r = 0; r < 2; ++r) {
      ShardedAverager loaded(r, 2, shardsFromFullTensors(model(), shard::LayoutKind::kFsdp2, r, 2),
                             copyingOptions());
      loadCheckpoint(folder, loaded);
      if (r == 0) step = loaded.step();
      EXPECT_EQ(loaded.step(), step) << "both ranks load one save";
      EXPECT_TRUE(step == reported || step == reported + 1)
          << "loaded step " << step << ", last reported " << reported;
      setSources(expected, step);
      const std::vector<LocalShard> rows =
          shardsFromFullTensors(expected, shard::LayoutKind::kFsdp2, r, 2);
      for (const LocalShard& row : rows) {
        EXPECT_TRUE(loaded.averager().ema(row.spec.name).equal(row.local))
            << row.spec.name << " of rank " << r << " at step " << step;
      }
    }
  }
  std::printf("%d of %d kills left a .tmp (landed in a write)\n", midSave, kKillsPerKind);
  saveAt(ranks[0]->step() + 1);
  std::set<std::string> left = filesIn(folder);
  EXPECT_EQ(left.size(), 3u) << "manifest.json and one file per rank, no .tmp or orphan";
  EXPECT_EQ(left.count("manifest.json"), 1u);
}

}  // namespace
}  // namespace shardema
