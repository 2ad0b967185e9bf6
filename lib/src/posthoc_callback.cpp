// PostHocCallback: the per-step lifecycle, snapshots and resume. The option
// checks live in posthoc_options.cpp, the validation swap and the
// end-of-training synthesis in posthoc_callback_finish.cpp, and what a
// resume sets aside in posthoc_set_aside.cpp.
#include "shardema/posthoc_callback.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <unordered_map>

#include "posthoc_options.h"
#include "posthoc_set_aside.h"
#include "sharded_internal.h"
#include "shardema/core/file_metadata.h"
#include "shardema/core/file_system.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/warning.h"
#include "shardema/ema_callback.h"
#include "shardema/shard/communicator.h"

namespace shardema {
namespace {

constexpr const char* kApi = "PostHocCallback";
constexpr const char* kCallsKey = detail::kPostHocCallsKey;

AveragerOptions averagerOptions(const PostHocCallbackOptions& o) {
  AveragerOptions out;
  for (size_t p = 0; p < o.sigmaRels.size(); ++p) {
    PowerScheduleOptions power;
    power.sigmaRel = o.sigmaRels[p];
    power.updateEvery = o.updateEvery;
    power.stepSizeCorrection = o.stepSizeCorrection;
    DecaySchedule schedule = DecaySchedule::powerFunction(power);
    if (p == 0) {
      out.schedule = schedule;
    } else {
      out.moreSchedules.push_back(schedule);
    }
  }
  out.pool = o.pool;
  out.copyOnFirstUpdate = true;  // nitrous: the first due update copies
  out.storage = o.storage;
  out.offload = o.offload;
  return out;
}

int64_t parseCalls(const std::string& text) {
  TORCH_CHECK_VALUE(!text.empty() && text.size() <= 18 &&
                        text.find_first_not_of("0123456789") == std::string::npos,
                    kApi, ": checkpoint metadata ", kCallsKey, " = '", text,
                    "' is not a call count");
  return std::strtoll(text.c_str(), nullptr, 10);
}

}  // namespace

PostHocCallback::PostHocCallback(PostHocCallbackOptions options, PostHocRanks ranks)
    : options_(std::move(options)), ranks_(ranks) {
  detail::checkPostHocOptions(options_);
  detail::checkPostHocRanks(ranks_, options_.layout);
  const auto normal = [](const std::string& folder) {
    return detail::lexicallyNormal(detail::absolutePath(folder));
  };
  TORCH_CHECK_VALUE(normal(outputFolderOf(options_)) != normal(options_.checkpointFolder), kApi,
                    ": the deployable weights would go into the snapshot folder ",
                    options_.checkpointFolder,
                    ", which must hold snapshots only; set outputFolder to another folder");
}

PostHocCallback::~PostHocCallback() = default;

bool PostHocCallback::holdsEma() const {
  const bool firstReplica = ranks_.replicas == nullptr || ranks_.replicas->rank() == 0;
  return (options_.layout == PostHocLayout::kSharded || ranks_.rank == 0) && firstReplica;
}

std::map<std::string, int64_t> PostHocCallback::splitDims() const {
  std::map<std::string, int64_t> out;
  for (const LocalShard& s : averager_->shards()) {
    if (s.splitDim > 0) out[s.spec.name] = s.splitDim;
  }
  return out;
}

const ShardedAverager& PostHocCallback::averager() const {
  TORCH_CHECK(averager_ != nullptr, kApi, "::averager: called before onFitStart");
  return *averager_;
}

std::string PostHocCallback::snapshotFolder() const {
  if (options_.layout == PostHocLayout::kSharded) {
    return detail::joinPath(options_.checkpointFolder, rankFolderName(ranks_.rank));
  }
  return options_.checkpointFolder;
}

std::string PostHocCallback::deployableFileName(const std::string& prefix, double sigmaRel,
                                                int64_t calls) {
  // Python's str(float): the shortest text that reads back as the same value.
  char sigma[32] = {0};
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(sigma, sizeof sigma, "%.*g", digits, sigmaRel);
    if (std::strtod(sigma, nullptr) == sigmaRel) break;
  }
  std::string text = sigma;
  for (char& c : text) {
    if (c == '.') c = 'p';
  }
  char step[32];
  std::snprintf(step, sizeof step, "%09lld", static_cast<long long>(calls));
  return prefix + "_sigma_" + text + "_step_" + step + ".safetensors";
}

void PostHocCallback::onFitStart(torch::nn::Module& module) {
  onFitStart(trackModule(module, options_.policy));
}

void PostHocCallback::onFitStart(std::vector<TrackedTensor> full) {
  if (options_.layout == PostHocLayout::kSharded) {
    // Every rank holds the whole replicated module but keeps the EMA of its
    // FSDP2 rows only; validation swaps the whole (gathered) EMA in.
    std::vector<LocalShard> rows =
        shardsFromFullTensors(full, shard::LayoutKind::kFsdp2, ranks_.rank, ranks_.worldSize);
    swapWholeTensors_ = true;
    build(std::move(rows), std::move(full));
    return;
  }
  // Rank 0 tracks everything; the other ranks only swap for validation.
  std::vector<LocalShard> shards;
  if (ranks_.rank == 0) {
    shards = shardsFromFullTensors(full, shard::LayoutKind::kRankZero, 0, ranks_.worldSize);
  }
  build(std::move(shards), std::move(full));
}

void PostHocCallback::onFitStart(std::vector<LocalShard> shards,
                                 std::vector<TrackedTensor> wholeReplicated) {
  TORCH_CHECK_VALUE(options_.layout == PostHocLayout::kSharded, kApi,
                    "::onFitStart(shards) is for the sharded layout; kRankZero takes "
                    "the module");
  std::unordered_map<std::string, TrackedTensor> whole;
  for (TrackedTensor& t : wholeReplicated) {
    const std::string name = t.name;
    TORCH_CHECK_VALUE(whole.emplace(name, std::move(t)).second, kApi,
                      "::onFitStart: wholeReplicated lists '", name, "' twice");
  }
  std::vector<TrackedTensor> targets;
  std::vector<std::string> gathered;
  for (const LocalShard& s : shards) {
    const auto found = whole.find(s.spec.name);
    if (found == whole.end()) {
      targets.push_back(TrackedTensor{s.spec.name, s.local, s.role, s.changesInForward});
      continue;
    }
    TORCH_CHECK_VALUE(s.spec.kind == shard::LayoutKind::kReplicated, kApi, "::onFitStart: '",
                      s.spec.name, "' is in wholeReplicated but its shard is ",
                      shard::layoutKindName(s.spec.kind), ", not replicated");
    TORCH_CHECK_VALUE(found->second.source.numel() == s.spec.numel(), kApi, "::onFitStart: '",
                      s.spec.name, "' in wholeReplicated has ", found->second.source.numel(),
                      " elements, its shard spec ", s.spec.numel());
    targets.push_back(std::move(found->second));
    gathered.push_back(s.spec.name);
    whole.erase(found);
  }
  TORCH_CHECK_VALUE(whole.empty(), kApi, "::onFitStart: wholeReplicated holds '",
                    whole.empty() ? std::string() : whole.begin()->first,
                    "', which no shard has");
  build(std::move(shards), std::move(targets));
  gatheredForSwap_ = std::move(gathered);
}

void PostHocCallback::build(std::vector<LocalShard> shards, std::vector<TrackedTensor> targets) {
  TORCH_CHECK(averager_ == nullptr, kApi, "::onFitStart: called twice");
  // HSDP's later replicas hold the first one's shards and keep no EMA of
  // them: the first replica's profiles and files stand for all of them.
  if (!holdsEma()) shards.clear();
  averager_ = std::make_unique<ShardedAverager>(ranks_.rank, ranks_.worldSize, std::move(shards),
                                                averagerOptions(options_));
  swapTargets_ = std::move(targets);
  if (!queuedCalls_) return;
  try {
    resumeAt(*queuedCalls_);
  } catch (...) {
    // A resume that fails (a missing or foreign snapshot) leaves no EMA
    // behind: a fresh one would train on as if the run had just started.
    averager_.reset();
    swapTargets_.clear();
    throw;
  }
  queuedCalls_.reset();
}

bool PostHocCallback::onTrainBatchEnd(int64_t globalStep, int64_t batchIdx,
                                      int64_t accumulateGradBatches, bool isLastBatch) {
  const bool stepped = optimizerStepped(batchIdx, accumulateGradBatches, isLastBatch);
  TORCH_CHECK(averager_ != nullptr, kApi, "::onTrainBatchEnd: called before onFitStart");
  TORCH_CHECK(!emaSwappedIn(), kApi,
              "::onTrainBatchEnd: called while the synthesized EMA is swapped in; call "
              "onValidationEnd() first");
  if (!stepped) return false;  // a micro-batch inside an accumulation window
  // A global step that did not advance is not another optimizer step.
  if (globalStep <= lastGlobalStep_) return false;
  lastGlobalStep_ = globalStep;
  // The seed counts iterations >= start_iter, 0-based.
  if (globalStep - 1 < options_.startIter) return false;
  // By the first counted call a resume has happened or never will: a
  // fresh run must not mix its snapshots with another run's.
  if (calls_ == 0) checkFolderIsFresh();
  // calls_ moves only once the update is queued: a refused update (say, a
  // forgotten fence) can be retried as the same call.
  const int64_t call = calls_ + 1;
  if (holdsEma()) averager_->update(call);
  calls_ = call;
  if (calls_ % options_.checkpointEvery == 0) writeSnapshots();
  return true;
}

void PostHocCallback::onBeforeOptimizerStep() {
  if (averager_ && holdsEma()) averager_->fence();
}

void PostHocCallback::wait() {
  if (averager_ && holdsEma()) averager_->wait();
}

void PostHocCallback::checkFolderIsFresh() const {
  if (!holdsEma()) return;
  const std::string folder = snapshotFolder();
  if (!detail::isDirectory(folder)) return;
  std::string error;
  const std::vector<std::string> names = detail::directoryNames(folder, &error);
  TORCH_CHECK_VALUE(error.empty(), kApi, ": cannot read the snapshot folder ", folder, ": ", error);
  for (const std::string& name : names) {
    TORCH_CHECK_VALUE(!parseSnapshotFileName(name, nullptr, nullptr), kApi, ": ", folder,
                      " already holds snapshots of another run (", name,
                      "); resume from that run's checkpoint (onLoadCheckpoint) or start in an "
                      "empty checkpointFolder, so the two runs' snapshots do not mix");
  }
}

void PostHocCallback::writeSnapshots() {
  if (!holdsEma()) {
    newestSnapshot_ = calls_;
    return;
  }
  writeProfiles(snapshotFolder());
  // Only now: a failed write must leave the step without snapshots on record.
  newestSnapshot_ = calls_;
}

std::string PostHocCallback::resumeFolder() const {
  return detail::joinPath(snapshotFolder(), "resume");
}

void PostHocCallback::writeProfiles(const std::string& folder) {
  detail::ensureDirectory(folder, kApi);
  const Averager& averager = averager_->averager();
  const bool sharded = options_.layout == PostHocLayout::kSharded;
  const std::string layoutJson = sharded ? averager_->layout().toJson() : std::string();
  for (int p = 0; p < averager.numProfiles(); ++p) {
    SnapshotInfo info;
    info.profileIndex = p;
    info.step = calls_;
    info.sigmaRel = averager.schedule(p).sigmaRel();
    info.gamma = averager.schedule(p).gamma();
    std::vector<std::pair<std::string, at::Tensor>> tensors = averager.emaTensors(p);
    if (sharded) {
      // A rank's file holds its range of each tensor as 1-D data.
      info.rank = ranks_.rank;
      info.worldSize = ranks_.worldSize;
      info.layoutJson = layoutJson;
      info.splitDims = splitDims();
      for (auto& named : tensors) named.second = named.second.reshape({-1});
    }
    writeSnapshot(detail::joinPath(folder, snapshotFileName(p, calls_)), tensors, info);
  }
}

std::string PostHocCallback::outputFolderOf(const PostHocCallbackOptions& options) {
  if (!options.outputFolder.empty()) return options.outputFolder;
  // The snapshot folder holds snapshots only (its scan refuses other
  // safetensors files), so by default the result goes beside it, as
  // nitrous writes {run_dir}/..._final next to {run_dir}/ema_ckpts.
  const std::string parent = detail::parentPath(detail::lexicallyNormal(options.checkpointFolder));
  return parent.empty() ? "." : parent;
}

void PostHocCallback::onSaveCheckpoint(TrainingCheckpoint& checkpoint) {
  if (calls_ > 0 && calls_ != newestSnapshot_ && averager_ != nullptr && holdsEma()) {
    // Between snapshot calls: the EMAs of this call, kept apart from the
    // snapshots (the synthesis must not see them), so a resume from this
    // checkpoint goes on from exactly these values. The file names carry
    // the call, so each checkpoint has its own.
    averager_->wait();
    writeProfiles(resumeFolder());
  }
  checkpoint.metadata[kCallsKey] = std::to_string(calls_);
}

void PostHocCallback::onLoadCheckpoint(const TrainingCheckpoint& checkpoint) {
  const auto found = checkpoint.metadata.find(kCallsKey);
  TORCH_CHECK_VALUE(found != checkpoint.metadata.end(), kApi,
                    "::onLoadCheckpoint: the checkpoint has no ", kCallsKey,
                    " (it was not saved with a PostHocCallback)");
  const int64_t calls = parseCalls(found->second);
  if (averager_) {
    resumeAt(calls);
  } else {
    queuedCalls_ = calls;
  }
}

void PostHocCallback::resumeAt(int64_t calls) {
  if (calls > 0 && holdsEma()) {
    Averager& averager = averager_->averager();
    std::unordered_map<std::string, std::vector<int64_t>> localShapes;
    for (const LocalShard& s : averager_->shards())
      localShapes[s.spec.name] = s.local.sizes().vec();
    const bool sharded = options_.layout == PostHocLayout::kSharded;
    const std::string layoutJson = sharded ? averager_->layout().toJson() : std::string();
    for (int p = 0; p < averager.numProfiles(); ++p) {
      // The snapshot at that call, else the resume state its checkpoint
      // wrote (a save between snapshot calls).
      const std::string snapshot = detail::joinPath(snapshotFolder(), snapshotFileName(p, calls));
      const std::string resume = detail::joinPath(resumeFolder(), snapshotFileName(p, calls));
      const bool atSnapshot = detail::pathExists(snapshot);
      const std::string path = atSnapshot ? snapshot : resume;
      TORCH_CHECK_VALUE(atSnapshot || detail::pathExists(resume), kApi,
                        ": cannot resume at call ", calls, ": neither the snapshot ", snapshot,
                        " nor the resume state ", resume,
                        " exists (the checkpoint's save writes one of them; were they moved "
                        "or deleted?)");
      const SnapshotInfo info = readSnapshotInfo(path);
      TORCH_CHECK_VALUE(info.gamma == averager.schedule(p).gamma(), kApi, ": ", path,
                        " holds sigma_rel ", info.sigmaRel, " but profile ", p, " tracks ",
                        options_.sigmaRels[p], "; resume with the same sigmaRels");
      TORCH_CHECK_VALUE(info.sharded() == sharded, kApi, ": ", path, " is a ",
                        info.sharded() ? "sharded" : "full-copy", " snapshot; this run uses the ",
                        sharded ? "sharded" : "rank-0 full-copy", " layout");
      TORCH_CHECK_VALUE(
          !sharded || (info.rank == ranks_.rank && info.worldSize == ranks_.worldSize &&
                       info.layoutJson == layoutJson),
          kApi, ": ", path, " was written by rank ", info.rank, " of ", info.worldSize,
          " with another shard layout; resuming post-hoc "
          "snapshots on another world size or layout is not supported");
      TORCH_CHECK_VALUE(info.splitDims == splitDims(), kApi, ": ", path,
                        " records other tensor-parallel splits (shardema.split_dims) than this "
                        "run's pieces; resume with the same parallelization");
      TensorFile file = readTensorFile(path);
      for (auto& [name, tensor] : file.tensors) {
        const auto shape = localShapes.find(name);
        if (shape != localShapes.end() && tensor.numel() == c10::multiply_integers(shape->second)) {
          tensor = tensor.reshape(shape->second);
        }
      }
      averager.loadEmaValues(file.tensors, LoadStrictness::kStrict, p);
    }
    // Call 1 is always due, so a run with calls > 0 has made its first copy.
    averager.restoreProgress(calls, /*initialized=*/true);
  }
  // The EMAs are loaded: now the folder holds what the uninterrupted run
  // held at `calls` (the snapshots on the grid), nothing from a run that
  // ended there (its final snapshot) or went further.
  if (holdsEma()) {
    const detail::SetAsideSnapshots moved = detail::setAsideSupersededSnapshots(
        snapshotFolder(), resumeFolder(), calls, options_.checkpointEvery);
    if (!moved.empty()) {
      detail::warn(detail::describeSetAside(snapshotFolder(), resumeFolder(), calls, moved));
    }
  }
  calls_ = calls;
  // The newest snapshot call at or before `calls` (what the validation
  // swap synthesizes at), as in the uninterrupted run: a call on the grid.
  newestSnapshot_ = calls - calls % options_.checkpointEvery;
  if (calls > 0 && holdsEma() &&
      detail::pathExists(detail::joinPath(snapshotFolder(), snapshotFileName(0, calls)))) {
    newestSnapshot_ = calls;
  }
}

}  // namespace shardema
