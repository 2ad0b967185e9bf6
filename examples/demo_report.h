#pragma once
// What the demo shows at the end of a run (rank 0 prints it): held-out loss
// of the raw weights, the warmup EMA and every post-hoc sigma_rel, the host
// memory each rank's EMAs take beside a full copy, and where the files went.
#include <cstdint>
#include <string>
#include <vector>

#include "posthoc_sweep.h"

namespace shardema::demo {

/// One rank's EMA storage in host memory.
struct RankMemory {
  int64_t warmupEmaBytes = 0;
  int64_t posthocEmaBytes = 0;  // every profile
};

struct RunReport {
  int64_t worldSize = 1;
  int64_t optimizerSteps = 0;
  int64_t heldOutSamples = 0;
  double rawLoss = 0;
  double emaLoss = 0;
  double emaDecay = 0;
  std::vector<SweepRow> sweep;
  double sweepSeconds = 0;
  int64_t snapshotsPerRank = 0;
  double deployableSigmaRel = 0;
  double trainSeconds = 0;
  /// Index = rank.
  std::vector<RankMemory> memory;
  /// The same EMAs as one full copy each (what every rank would hold
  /// without sharding, and what rank 0 holds in the DDP lifecycle).
  int64_t fullWarmupEmaBytes = 0;
  int64_t fullPosthocEmaBytes = 0;
  std::string emaWeightsPath, posthocWeightsPath, snapshotFolder, svgPath, checkpointPath;
};

/// The end-of-run table on stdout.
void printReport(const RunReport& report);

/// One line of progress: redrawn in place on a terminal (a bar), a plain
/// line otherwise (logs, CI).
void printProgress(bool tty, int64_t step, int64_t total, double loss, double decay);

}  // namespace shardema::demo
