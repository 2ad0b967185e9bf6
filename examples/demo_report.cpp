#include "demo_report.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace shardema::demo {
namespace {

std::string kib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f KiB", static_cast<double>(bytes) / 1024.0);
  return text;
}

void printMemory(const RunReport& r) {
  std::printf("\nEMA host memory per rank (fp32, pinned host; no accelerator memory)\n");
  std::printf("  %-6s %-14s %-22s\n", "rank", "warmup EMA", "post-hoc EMAs");
  for (size_t rank = 0; rank < r.memory.size(); ++rank) {
    std::printf("  %-6zu %-14s %-22s\n", rank, kib(r.memory[rank].warmupEmaBytes).c_str(),
                kib(r.memory[rank].posthocEmaBytes).c_str());
  }
  std::printf("  %-6s %-14s %-22s\n", "full", kib(r.fullWarmupEmaBytes).c_str(),
              kib(r.fullPosthocEmaBytes).c_str());
  int64_t largest = 0;
  for (const RankMemory& m : r.memory) {
    largest = std::max(largest, m.warmupEmaBytes + m.posthocEmaBytes);
  }
  const int64_t full = r.fullWarmupEmaBytes + r.fullPosthocEmaBytes;
  std::printf("  largest rank holds %.0f%% of a full copy (%lld ranks)\n",
              full > 0 ? 100.0 * static_cast<double>(largest) / static_cast<double>(full) : 0.0,
              static_cast<long long>(r.worldSize));
}

}  // namespace

void printProgress(bool tty, int64_t step, int64_t total, double loss, double decay) {
  if (tty) {
    const int width = 30;
    const int filled = static_cast<int>(width * step / total);
    std::printf("\r[%-*s] step %lld/%lld  loss %.4f  ema decay %.5f", width,
                std::string(filled, '#').c_str(), static_cast<long long>(step),
                static_cast<long long>(total), loss, decay);
    if (step == total) std::printf("\n");
    std::fflush(stdout);
  } else {
    std::printf("step %lld/%lld loss %.4f ema_decay %.5f\n", static_cast<long long>(step),
                static_cast<long long>(total), loss, decay);
  }
}

void printReport(const RunReport& r) {
  const auto vsRaw = [&](double loss) { return 100.0 * (loss - r.rawLoss) / r.rawLoss; };
  std::printf(
      "\nheld-out MSE after %lld optimizer steps on %lld ranks in %.1f s "
      "(clean targets, %lld samples)\n",
      static_cast<long long>(r.optimizerSteps), static_cast<long long>(r.worldSize), r.trainSeconds,
      static_cast<long long>(r.heldOutSamples));
  std::printf("  %-26s %.5f\n", "raw weights", r.rawLoss);
  std::printf("  %-26s %.5f  (%+.1f%% vs raw, final decay %.5f)\n", "warmup EMA weights", r.emaLoss,
              vsRaw(r.emaLoss), r.emaDecay);
  const size_t best = bestSweepRow(r.sweep);
  for (size_t i = 0; i < r.sweep.size(); ++i) {
    const SweepRow& row = r.sweep[i];
    char label[64];
    std::snprintf(label, sizeof(label), "post-hoc sigma_rel %g", row.sigmaRel);
    std::printf("  %-26s %.5f  (%+.1f%% vs raw)%s%s\n", label, row.heldOutLoss,
                vsRaw(row.heldOutLoss), row.badlyConditioned ? "  ill-conditioned" : "",
                i == best ? "  <- best" : "");
  }
  // The Gram matrix depends on the snapshots only, not on the target, so one
  // condition number describes every row.
  std::printf(
      "post-hoc sweep: %zu sigma_rel value%s synthesized shard by shard from %lld snapshots "
      "per rank and gathered, in %.2f s (condition number %.2g)\n",
      r.sweep.size(), r.sweep.size() == 1 ? "" : "s", static_cast<long long>(r.snapshotsPerRank),
      r.sweepSeconds, r.sweep.front().conditionNumber);
  printMemory(r);
  std::printf("\ndeployable EMA weights: %s\n", r.emaWeightsPath.c_str());
  std::printf("deployable post-hoc EMA weights (sigma_rel %g): %s\n", r.deployableSigmaRel,
              r.posthocWeightsPath.c_str());
  std::printf("post-hoc snapshots (one folder per rank): %s\n", r.snapshotFolder.c_str());
  std::printf("sweep picture: %s\n", r.svgPath.c_str());
  std::printf("training checkpoint (raw weights + sharded warmup EMA state): %s\n",
              r.checkpointPath.c_str());
}

}  // namespace shardema::demo
