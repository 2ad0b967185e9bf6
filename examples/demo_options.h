#pragma once
// The demo's command line: what to train, on how many local ranks, where
// the files go. Bad flags are a UsageError (one line, exit status 2).
#include <cstdint>
#include <string>
#include <vector>

namespace shardema::demo {

struct DemoOptions {
  /// Local ranks (processes), each holding its FSDP2 rows of the EMAs.
  int64_t worldSize = 2;
  int64_t steps = 1500;
  int64_t width = 64;
  /// Global batch, split evenly over the ranks (a multiple of worldSize).
  int64_t batch = 32;
  int64_t accumulate = 1;
  double lr = 0.1;
  double noise = 1.0;
  int64_t seed = 0;
  std::string out = "out/demo";
  /// sigma_rel values the post-hoc sweep synthesizes, ascending; the range
  /// brackets the usual optimum (Karras et al. find 0.05-0.15) on both sides.
  std::vector<double> sigmaGrid = {0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.13, 0.16, 0.2, 0.25};
  /// Optimizer steps between post-hoc snapshots; 0 = steps / 10 (at least 1),
  /// enough snapshots for a well-conditioned synthesis at little disk cost.
  int64_t snapshotEvery = 0;
};

/// Parses argv[1..]; prints the usage and exits 0 for --help. Throws
/// shardema::cli::UsageError naming the flag for anything else wrong.
DemoOptions parseDemoOptions(int argc, char** argv);

}  // namespace shardema::demo
