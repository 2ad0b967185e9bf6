#include "demo_options.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>

#include "flag_parser.h"
#include "shardema/core/power_function.h"

namespace shardema::demo {
namespace {

using shardema::cli::FlagArity;
using shardema::cli::FlagSpec;

const char* kUsage =
    "usage: ema_demo [--world-size W] [--steps N] [--width N] [--batch N]\n"
    "                [--accumulate N] [--lr X] [--noise X] [--seed N] [--out DIR]\n"
    "                [--sigma-grid A,B,...] [--snapshot-every N]\n"
    "Trains a small MLP on a noisy synthetic regression task on W local ranks\n"
    "(default 2 processes started by the demo, Gloo over loopback, gradients\n"
    "averaged through c10d) with shardema's sharded warmup EMA and post-hoc\n"
    "EMA (each rank keeps its FSDP2 rows in host memory), then compares the\n"
    "held-out loss of the raw weights, the warmup EMA and the post-hoc EMA\n"
    "synthesized for each sigma_rel of --sigma-grid (default 0.01,...,0.25)\n"
    "from snapshots taken every --snapshot-every optimizer steps (default\n"
    "steps/10). The sweep is also drawn to DIR/posthoc_sweep.svg.\n";

// "0.05,0.1": ascending, duplicates dropped (the picture's x axis is
// sigma_rel), each inside the power profiles' range.
std::vector<double> parseSigmaGrid(const std::string& text) {
  std::vector<double> grid;
  for (const std::string& item : shardema::cli::splitList("sigma-grid", text, ',')) {
    const double sigmaRel = shardema::cli::parseNumber("sigma-grid", item);
    if (!(sigmaRel > 0 && sigmaRel < shardema::kMaxSigmaRel)) {
      throw shardema::cli::UsageError("--sigma-grid: " + item +
                                      " is outside (0, 0.2887), the sigma_rel range");
    }
    grid.push_back(sigmaRel);
  }
  std::sort(grid.begin(), grid.end());
  grid.erase(std::unique(grid.begin(), grid.end()), grid.end());
  return grid;
}

}  // namespace

DemoOptions parseDemoOptions(int argc, char** argv) {
  const std::vector<FlagSpec> specs = {
      {"world-size"}, {"steps"},      {"width"},          {"batch"},
      {"accumulate"}, {"lr"},         {"noise"},          {"seed"},
      {"out"},        {"sigma-grid"}, {"snapshot-every"}, {"help", FlagArity::kNone}};
  const auto flags =
      shardema::cli::parseFlags(specs, std::vector<std::string>(argv + 1, argv + argc));
  if (flags.boolean("help")) {
    std::cout << kUsage;
    std::exit(0);
  }
  DemoOptions o;
  auto positive = [&](const char* name, int64_t& field) {
    if (!flags.has(name)) return;
    field = flags.integer(name);
    if (field < 1) throw shardema::cli::UsageError(std::string("--") + name + " must be >= 1");
  };
  positive("world-size", o.worldSize);
  positive("steps", o.steps);
  positive("width", o.width);
  positive("batch", o.batch);
  positive("accumulate", o.accumulate);
  positive("snapshot-every", o.snapshotEvery);
  if (flags.has("sigma-grid")) o.sigmaGrid = parseSigmaGrid(flags.text("sigma-grid"));
  if (flags.has("lr")) o.lr = flags.number("lr");
  if (flags.has("noise")) o.noise = flags.number("noise");
  if (flags.has("seed")) o.seed = flags.integer("seed");
  if (flags.has("out")) o.out = flags.text("out");
  if (o.lr <= 0) throw shardema::cli::UsageError("--lr must be > 0");
  if (o.noise < 0) throw shardema::cli::UsageError("--noise must be >= 0");
  if (o.worldSize > 8) throw shardema::cli::UsageError("--world-size must be <= 8 (local ranks)");
  if (o.batch % o.worldSize != 0) {
    throw shardema::cli::UsageError("--batch (" + std::to_string(o.batch) +
                                    ") must be a multiple of --world-size (" +
                                    std::to_string(o.worldSize) + ")");
  }
  return o;
}

}  // namespace shardema::demo
