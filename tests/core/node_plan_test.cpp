#include "shardema/core/node_plan.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "shardema/offload/update_pipeline.h"
#include "support/value_error.h"

namespace shardema {
namespace {

NodePlanInputs sevenBillionOnEight() {
  NodePlanInputs in;
  in.parameters = 7'000'000'000;
  in.ranks = 8;
  return in;
}

// Every figure of one node of a 7B model on 8 ranks with the defaults,
// worked out by hand from the model's definition (node_plan.h):
//   875e6 elements per rank; fp32 sources, one profile;
//   PCIe 875e6 x 4 B = 3.5 GB per rank at 50 GB/s = 70 ms, 28 GB a node;
//   host memory 7e9 x (2 x 4 + 8) B = 112 GB at 400 GB/s = 280 ms;
//   kernel 7e9 x 12 B = 84 GB, one core at 46.8 GB/s: 1.7948... s;
//   step 6 x 7e9 x 8192 / 400e12 = 0.86016 s, so 3 cores keep pace and the
//   floor of one worker per rank (8) wins; the update takes the host
//   memory's 280 ms, inside the step: only the 1.4 ms call is added.
TEST(NodePlanTest, SevenBillionOnEightRanksByHand) {
  const NodePlan plan = planNode(sevenBillionOnEight());
  EXPECT_EQ(plan.ranksPerNode, 8);
  EXPECT_EQ(plan.elementsPerRank, 875'000'000);
  EXPECT_EQ(plan.elementsPerNode, 7'000'000'000);
  EXPECT_EQ(plan.pcieBytes, 28'000'000'000);
  EXPECT_DOUBLE_EQ(plan.pcieSeconds, 0.07);
  EXPECT_EQ(plan.hostMemoryBytes, 112'000'000'000);
  EXPECT_DOUBLE_EQ(plan.hostMemorySeconds, 0.28);
  EXPECT_EQ(plan.kernelBytes, 84'000'000'000);
  EXPECT_DOUBLE_EQ(plan.coreSeconds, 84.0 / 46.8);
  EXPECT_DOUBLE_EQ(plan.stepSeconds, 0.86016);
  EXPECT_EQ(plan.coresNeeded, 8);
  EXPECT_DOUBLE_EQ(plan.emaSeconds, 0.28);
  EXPECT_DOUBLE_EQ(plan.overheadSeconds, 1.4e-3);
  EXPECT_DOUBLE_EQ(plan.overheadFraction(1), 1.4e-3 / 0.86016);
  EXPECT_DOUBLE_EQ(plan.overheadFraction(10), 1.4e-4 / 0.86016);
  EXPECT_EQ(plan.hostRamBytes, 28'000'000'000 + 8 * (int64_t{32} << 20));
  EXPECT_DOUBLE_EQ(plan.ramFraction, static_cast<double>(plan.hostRamBytes) / (2048.0 * (1 << 30)));
}

// A step shorter than the host memory's 280 ms: the update stalls the step
// by the difference, and update_every spreads that over its steps.
TEST(NodePlanTest, AStepShorterThanTheUpdateIsStalledByTheDifference) {
  NodePlanInputs in = sevenBillionOnEight();
  in.stepSeconds = 0.1;
  const NodePlan plan = planNode(in);
  EXPECT_DOUBLE_EQ(plan.stepSeconds, 0.1);
  EXPECT_DOUBLE_EQ(plan.emaSeconds, 0.28);
  EXPECT_DOUBLE_EQ(plan.overheadSeconds, 0.18 + 1.4e-3);
  EXPECT_DOUBLE_EQ(plan.overheadFraction(10), (0.18 + 1.4e-3) / 10 / 0.1);
  // The math keeps pace with the 280 ms host memory: ceil(1.7948 / 0.28) = 7
  // cores, below the floor of 8 workers.
  EXPECT_EQ(plan.coresNeeded, 8);
}

// Slow cores: the node needs ceil(84 / 0.86016) = 98 of them, and with
// them the math fits the step exactly as far as it can.
TEST(NodePlanTest, SlowCoresRaiseTheCoresNeededNotTheOverhead) {
  NodePlanInputs in = sevenBillionOnEight();
  in.coreGbps = 1.0;
  const NodePlan plan = planNode(in);
  EXPECT_EQ(plan.coresNeeded, 98);
  EXPECT_DOUBLE_EQ(plan.emaSeconds, 84.0 / 98);
  EXPECT_LE(plan.emaSeconds, plan.stepSeconds);
  EXPECT_DOUBLE_EQ(plan.overheadSeconds, 1.4e-3);
}

// Post-hoc's two bf16-sourced profiles on a node that runs 3 of 3 ranks:
// the ranks split 10 elements as 4, 4, 2 (the busiest node counts 4 each).
TEST(NodePlanTest, ProfilesSourceBytesAndUnevenShards) {
  NodePlanInputs in;
  in.parameters = 10;
  in.ranks = 3;
  in.sourceBytes = 2;
  in.profiles = 2;
  in.stagingBytesPerRank = 100;
  in.stepSeconds = 1.0;
  const NodePlan plan = planNode(in);
  EXPECT_EQ(plan.ranksPerNode, 3);
  EXPECT_EQ(plan.elementsPerRank, 4);
  EXPECT_EQ(plan.elementsPerNode, 12);
  EXPECT_EQ(plan.pcieBytes, 12 * 2);
  EXPECT_EQ(plan.hostMemoryBytes, 12 * (2 * 2 + 16));
  EXPECT_EQ(plan.kernelBytes, 12 * (2 + 16));
  EXPECT_EQ(plan.hostRamBytes, 12 * 8 + 3 * 100);
}

// More ranks than a node has GPUs: the node runs gpusPerNode of them, and
// its share of the model shrinks with the world size.
TEST(NodePlanTest, ANodeRunsItsGpusWorthOfRanks) {
  NodePlanInputs in = sevenBillionOnEight();
  in.ranks = 1024;
  const NodePlan plan = planNode(in);
  EXPECT_EQ(plan.ranksPerNode, 8);
  EXPECT_EQ(plan.elementsPerRank, (7'000'000'000 + 1023) / 1024);
  EXPECT_EQ(plan.elementsPerNode, 8 * plan.elementsPerRank);
  EXPECT_DOUBLE_EQ(plan.stepSeconds, 0.86016);  // a GPU's work does not shrink with FSDP
}

// The default staging is the pipeline's: numSlots x chunkBytes.
TEST(NodePlanTest, DefaultStagingIsThePipelines) {
  EXPECT_EQ(NodePlanInputs{}.stagingBytesPerRank,
            offload::kDefaultChunkBytes * offload::kDefaultNumSlots);
}

TEST(NodePlanTest, EachBadInputIsNamed) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<std::string, std::function<void(NodePlanInputs&)>>> cases = {
      {"parameters (0)", [](NodePlanInputs& in) { in.parameters = 0; }},
      {"parameters (", [](NodePlanInputs& in) { in.parameters = (int64_t{1} << 50) + 1; }},
      {"ranks (0)", [](NodePlanInputs& in) { in.ranks = 0; }},
      {"gpus_per_node (0)", [](NodePlanInputs& in) { in.gpusPerNode = 0; }},
      {"source_bytes (3)", [](NodePlanInputs& in) { in.sourceBytes = 3; }},
      {"profiles (0)", [](NodePlanInputs& in) { in.profiles = 0; }},
      {"profiles (17)", [](NodePlanInputs& in) { in.profiles = 17; }},
      {"pcie_gbps (0)", [](NodePlanInputs& in) { in.pcieGbps = 0; }},
      {"host_memory_gbps (-1)", [](NodePlanInputs& in) { in.hostMemoryGbps = -1; }},
      {"core_gbps (nan)", [nan](NodePlanInputs& in) { in.coreGbps = nan; }},
      {"tokens_per_gpu (0)", [](NodePlanInputs& in) { in.tokensPerGpu = 0; }},
      {"gpu_tflops (0)", [](NodePlanInputs& in) { in.gpuTflops = 0; }},
      {"node_ram_gib (0)", [](NodePlanInputs& in) { in.nodeRamGib = 0; }},
      {"step_seconds (-1)", [](NodePlanInputs& in) { in.stepSeconds = -1; }},
      {"staging_bytes_per_rank (-1)", [](NodePlanInputs& in) { in.stagingBytesPerRank = -1; }},
      {"update_call_seconds (-1)", [](NodePlanInputs& in) { in.updateCallSeconds = -1; }},
  };
  for (const auto& [named, spoil] : cases) {
    NodePlanInputs in = sevenBillionOnEight();
    spoil(in);
    EXPECT_VALUE_ERROR(planNode(in), "planNode: " + named);
  }
  const NodePlan plan = planNode(sevenBillionOnEight());
  EXPECT_VALUE_ERROR(plan.overheadFraction(0), "update_every (0)");
}

}  // namespace
}  // namespace shardema
