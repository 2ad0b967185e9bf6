#include "posthoc_options.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <string>

#include "sharded_internal.h"
#include "shardema/core/power_function.h"
#include "shardema/core/update_kernels.h"
#include "shardema/shard/communicator.h"

namespace shardema::detail {
namespace {

constexpr const char* kOptionsApi = "PostHocCallback";
// The smallest chunk the pipeline takes (one cache line); checked here so a
// bad value fails at construction rather than at onFitStart.
constexpr int64_t kMinChunkBytes = 64;

// 17 significant digits: the limit as a double, not the stream's 6 digits
// (0.288675 would read as a value inside the range).
std::string exactly(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

// sigma_rel of the power function t^gamma falls from 1/sqrt(12) (gamma -> 0,
// a uniform average) towards 0 as gamma grows; the engine's profiles have
// gamma > 0 (core's sigmaRelToGamma), so this open range is exactly theirs.
void checkSigma(double sigma, const std::string& what) {
  TORCH_CHECK_VALUE(std::isfinite(sigma) && sigma > 0 && sigma < kMaxSigmaRel, kOptionsApi, ": ",
                    what, " must lie in (0, 1/sqrt(12) = ", exactly(kMaxSigmaRel),
                    "), the sigma_rel of power-function EMAs with gamma > 0, got ", exactly(sigma));
}

void checkSigmaRels(const std::vector<double>& sigmaRels) {
  TORCH_CHECK_VALUE(
      sigmaRels.size() >= 2, kOptionsApi,
      ": sigmaRels needs at least 2 values (the synthesis solves over profiles), got ",
      sigmaRels.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(sigmaRels.size()) <= kMaxProfiles, kOptionsApi,
                    ": sigmaRels holds ", sigmaRels.size(), " values; at most ", kMaxProfiles,
                    " profiles are tracked in one pass");
  std::set<double> seen;
  for (size_t i = 0; i < sigmaRels.size(); ++i) {
    checkSigma(sigmaRels[i], "sigmaRels[" + std::to_string(i) + "]");
    TORCH_CHECK_VALUE(seen.insert(sigmaRels[i]).second, kOptionsApi, ": sigmaRels lists ",
                      exactly(sigmaRels[i]),
                      " twice; two equal profiles make the synthesis singular");
  }
}

// An enum field set from an integer (a cast, a file) can hold a value no
// enumerator has; the switch statements downstream would fall through.
void checkEnums(const PostHocCallbackOptions& o) {
  TORCH_CHECK_VALUE(o.layout == PostHocLayout::kRankZero || o.layout == PostHocLayout::kSharded,
                    kOptionsApi, ": layout must be kRankZero or kSharded, got ",
                    static_cast<int>(o.layout));
  TORCH_CHECK_VALUE(o.storage == EmaStorage::kPinnedHost || o.storage == EmaStorage::kDevice,
                    kOptionsApi, ": storage must be kPinnedHost or kDevice, got ",
                    static_cast<int>(o.storage));
  TORCH_CHECK_VALUE(
      o.policy == TrackingPolicy::kVersatil || o.policy == TrackingPolicy::kEmaPytorch, kOptionsApi,
      ": policy must be kVersatil or kEmaPytorch, got ", static_cast<int>(o.policy));
  const offload::EngineChoice engine = o.offload.engine;
  TORCH_CHECK_VALUE(engine == offload::EngineChoice::kAuto ||
                        engine == offload::EngineChoice::kHost ||
                        engine == offload::EngineChoice::kCuda,
                    kOptionsApi, ": offload.engine must be kAuto, kHost or kCuda, got ",
                    static_cast<int>(engine));
}

}  // namespace

void checkPostHocOptions(const PostHocCallbackOptions& o) {
  checkSigmaRels(o.sigmaRels);
  checkSigma(o.defaultOutputSigma, "defaultOutputSigma");
  TORCH_CHECK_VALUE(o.updateEvery >= 1, kOptionsApi, ": updateEvery must be >= 1, got ",
                    o.updateEvery);
  TORCH_CHECK_VALUE(o.checkpointEvery >= 1, kOptionsApi, ": checkpointEvery must be >= 1, got ",
                    o.checkpointEvery);
  TORCH_CHECK_VALUE(!o.checkpointFolder.empty(), kOptionsApi,
                    ": checkpointFolder is required (where the snapshots go)");
  TORCH_CHECK_VALUE(o.startIter >= 0, kOptionsApi, ": startIter must be >= 0, got ", o.startIter);
  checkEnums(o);
  TORCH_CHECK_VALUE(o.offload.chunkBytes >= kMinChunkBytes, kOptionsApi,
                    ": offload.chunkBytes must be >= ", kMinChunkBytes, ", got ",
                    o.offload.chunkBytes);
  TORCH_CHECK_VALUE(o.offload.numSlots >= 1, kOptionsApi, ": offload.numSlots must be >= 1, got ",
                    o.offload.numSlots);
  TORCH_CHECK_VALUE(!o.outputPrefix.empty() && o.outputPrefix.find('/') == std::string::npos,
                    kOptionsApi, ": outputPrefix must be a non-empty file name prefix, got '",
                    o.outputPrefix, "'");
  checkExportDtype(o.outputDtype, "PostHocCallback: outputDtype");
  TORCH_CHECK_VALUE(o.bufferBytes >= 64, kOptionsApi, ": bufferBytes must be >= 64, got ",
                    o.bufferBytes);
}

void checkPostHocRanks(const PostHocRanks& r, PostHocLayout layout) {
  TORCH_CHECK_VALUE(r.worldSize >= 1 && r.rank >= 0 && r.rank < r.worldSize, kOptionsApi, ": rank ",
                    r.rank, " is outside the world size ", r.worldSize);
  if (r.comm != nullptr) {
    TORCH_CHECK_VALUE(r.comm->rank() == r.rank && r.comm->worldSize() == r.worldSize, kOptionsApi,
                      ": the communicator is rank ", r.comm->rank(), " of ", r.comm->worldSize(),
                      " but ranks says ", r.rank, " of ", r.worldSize);
  }
  TORCH_CHECK_VALUE(layout != PostHocLayout::kSharded || r.worldSize == 1 || r.comm != nullptr,
                    kOptionsApi, ": the sharded layout with worldSize ", r.worldSize,
                    " needs ranks.comm (onTrainEnd gathers the synthesized shards)");
  TORCH_CHECK_VALUE(r.replicas == nullptr || layout == PostHocLayout::kSharded, kOptionsApi,
                    ": ranks.replicas (HSDP) needs the sharded layout; the rank-0 layout keeps "
                    "full EMAs on rank 0 of the job");
}

}  // namespace shardema::detail
