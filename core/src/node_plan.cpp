#include "shardema/core/node_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "shardema/core/update_kernels.h"

namespace shardema {
namespace {

constexpr const char* kApi = "planNode";
// 2^50 (about 10^15) parameters at the most bytes per element (4 + 8 x 16)
// stays far inside int64_t, so byte counts never overflow.
constexpr int64_t kMaxParameters = int64_t{1} << 50;

// Every input is checked before any arithmetic, so a bad one is named
// rather than turned into an infinity or a negative count.
void checkInputs(const NodePlanInputs& in) {
  TORCH_CHECK_VALUE(in.parameters > 0 && in.parameters <= kMaxParameters, kApi, ": parameters (",
                    in.parameters, ") must be in [1, 2^50]");
  TORCH_CHECK_VALUE(in.ranks >= 1, kApi, ": ranks (", in.ranks, ") must be >= 1");
  TORCH_CHECK_VALUE(in.gpusPerNode >= 1, kApi, ": gpus_per_node (", in.gpusPerNode,
                    ") must be >= 1");
  TORCH_CHECK_VALUE(in.sourceBytes == 2 || in.sourceBytes == 4, kApi, ": source_bytes (",
                    in.sourceBytes, ") must be 2 (bf16, fp16) or 4 (float32)");
  TORCH_CHECK_VALUE(in.profiles >= 1 && in.profiles <= kMaxProfiles, kApi, ": profiles (",
                    in.profiles, ") must be in [1, ", kMaxProfiles, "]");
  const auto positive = [](const char* name, double value) {
    TORCH_CHECK_VALUE(std::isfinite(value) && value > 0.0, kApi, ": ", name, " (", value,
                      ") must be > 0");
  };
  positive("pcie_gbps", in.pcieGbps);
  positive("host_memory_gbps", in.hostMemoryGbps);
  positive("core_gbps", in.coreGbps);
  positive("tokens_per_gpu", in.tokensPerGpu);
  positive("gpu_tflops", in.gpuTflops);
  positive("node_ram_gib", in.nodeRamGib);
  TORCH_CHECK_VALUE(std::isfinite(in.stepSeconds) && in.stepSeconds >= 0.0, kApi,
                    ": step_seconds (", in.stepSeconds, ") must be >= 0 (0: derived)");
  TORCH_CHECK_VALUE(in.stagingBytesPerRank >= 0, kApi, ": staging_bytes_per_rank (",
                    in.stagingBytesPerRank, ") must be >= 0");
  TORCH_CHECK_VALUE(std::isfinite(in.updateCallSeconds) && in.updateCallSeconds >= 0.0, kApi,
                    ": update_call_seconds (", in.updateCallSeconds, ") must be >= 0");
}

int64_t bytesOf(int64_t elements, int64_t bytesPerElement) { return elements * bytesPerElement; }

}  // namespace

double NodePlan::overheadFraction(int64_t updateEvery) const {
  TORCH_CHECK_VALUE(updateEvery >= 1, "NodePlan::overheadFraction: update_every (", updateEvery,
                    ") must be >= 1");
  return overheadSeconds / static_cast<double>(updateEvery) / stepSeconds;
}

NodePlan planNode(const NodePlanInputs& in) {
  checkInputs(in);
  NodePlan plan;
  plan.inputs = in;
  plan.ranksPerNode = std::min(in.ranks, in.gpusPerNode);
  plan.elementsPerRank = (in.parameters + in.ranks - 1) / in.ranks;
  plan.elementsPerNode = plan.elementsPerRank * plan.ranksPerNode;

  const int64_t emaBytesPerElement = 8 * in.profiles;  // read and write each float32 profile
  plan.pcieBytes = bytesOf(plan.elementsPerNode, in.sourceBytes);
  plan.pcieSeconds =
      static_cast<double>(bytesOf(plan.elementsPerRank, in.sourceBytes)) / (in.pcieGbps * 1e9);
  plan.hostMemoryBytes = bytesOf(plan.elementsPerNode, 2 * in.sourceBytes + emaBytesPerElement);
  plan.hostMemorySeconds = static_cast<double>(plan.hostMemoryBytes) / (in.hostMemoryGbps * 1e9);
  plan.kernelBytes = bytesOf(plan.elementsPerNode, in.sourceBytes + emaBytesPerElement);
  plan.coreSeconds = static_cast<double>(plan.kernelBytes) / (in.coreGbps * 1e9);

  plan.stepSeconds = in.stepSeconds > 0.0 ? in.stepSeconds
                                          : 6.0 * static_cast<double>(in.parameters) *
                                                in.tokensPerGpu / (in.gpuTflops * 1e12);
  // The math need not be faster than the slowest of the window it overlaps
  // and the stages that feed it.
  const double pace = std::max({plan.stepSeconds, plan.pcieSeconds, plan.hostMemorySeconds});
  const auto forPace = static_cast<int64_t>(std::ceil(plan.coreSeconds / pace));
  plan.coresNeeded = std::max(plan.ranksPerNode, forPace);
  plan.emaSeconds = std::max({plan.pcieSeconds, plan.hostMemorySeconds,
                              plan.coreSeconds / static_cast<double>(plan.coresNeeded)});
  plan.overheadSeconds = std::max(0.0, plan.emaSeconds - plan.stepSeconds) + in.updateCallSeconds;

  plan.hostRamBytes =
      bytesOf(plan.elementsPerNode, 4 * in.profiles) + in.stagingBytesPerRank * plan.ranksPerNode;
  plan.ramFraction = static_cast<double>(plan.hostRamBytes) / (in.nodeRamGib * 1073741824.0);
  return plan;
}

}  // namespace shardema
