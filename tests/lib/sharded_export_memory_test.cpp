// The offline export streams: exporting ~200 MB of EMA with 8 MB buffers
// raises the process's peak RSS (VmHWM, reset through /proc/self/clear_refs)
// by far less than the model, and by less than the largest tensor.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "shardema/detail/rank_manifest.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "support/temp_dir.h"

namespace shardema {
namespace {

// A /proc/self/status field in kB (-1 when absent).
int64_t statusKb(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  }
  return -1;
}

// Writing "5" resets VmHWM to the current RSS (Linux >= 4.0).
bool resetPeakRss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return clear.good();
}

TEST(ShardedExportMemoryTest, OfflineExportPeakRssStaysBounded) {
  testing::TempDir dir;
  constexpr int64_t kWorld = 2;
  // 211 MiB of fp32 EMA: one 128 MiB tensor and 83 MiB more in three. Two
  // ranks, so a rank's piece of the big tensor (64 MiB) alone would break the
  // bound if the export read pieces whole.
  const std::vector<std::vector<int64_t>> shapes = {
      {8192, 4096}, {4096, 2048}, {2048, 2048}, {4500, 2048}};
  int64_t totalBytes = 0;
  for (const auto& shape : shapes) totalBytes += at::empty(shape, at::kFloat).numel() * 4;
  // Ranks are built and saved one at a time so only one rank's memory is
  // ever live here (as on a real rank).
  RankManifest manifest;
  for (int64_t r = 0; r < kWorld; ++r) {
    std::vector<LocalShard> shards;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const shard::ShardSpec spec =
          shard::fsdp2Spec("t" + std::to_string(i), shapes[i], at::kFloat, kWorld);
      const int64_t n = spec.rangeOf(r).size();
      shards.push_back({at::full({n}, static_cast<float>(i + 1 + r), at::kFloat), spec});
    }
    AveragerOptions options;
    options.storage = EmaStorage::kDevice;  // CPU tensors: EMA on the host, no pipeline
    ShardedAverager averager(r, kWorld, std::move(shards), options);
    averager.update(1);
    if (r == 0) manifest = manifestFor(averager);
    manifest.files.push_back(writeRankFile(dir.file("ckpt"), averager));
  }
  writeManifest(dir.file("ckpt"), manifest);

  // Hand freed heap back to the OS first: memory the save phase freed but
  // glibc kept would otherwise absorb the export's allocations unseen.
  ::malloc_trim(0);
  if (!resetPeakRss()) GTEST_SKIP() << "/proc/self/clear_refs not writable";
  const int64_t before = statusKb("VmHWM");
  // The reset worked: the peak is the current RSS, not the save phase's.
  EXPECT_LT(before - statusKb("VmRSS"), 4096) << "VmHWM was not reset";
  ExportOptions options;
  options.bufferBytes = int64_t{8} << 20;
  const ExportSummary summary = exportCheckpoint(dir.file("ckpt"), dir.file("out"), options);
  const int64_t growthMb = (statusKb("VmHWM") - before) / 1024;
  std::printf("offline export of %lld MiB with 8 MiB buffers: peak RSS %lld -> %lld MiB (+%lld)\n",
              static_cast<long long>(totalBytes >> 20), static_cast<long long>(before / 1024),
              static_cast<long long>(statusKb("VmHWM") / 1024), static_cast<long long>(growthMb));
  EXPECT_GE(summary.bytes, static_cast<uint64_t>(totalBytes));
  EXPECT_LT(growthMb, 64) << "the export should not hold a tensor (128 MiB) or the model";
}

}  // namespace
}  // namespace shardema
