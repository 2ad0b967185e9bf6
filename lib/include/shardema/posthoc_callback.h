#pragma once
// PostHocCallback: the post-hoc EMA lifecycle (DESIGN.md section 4) of
// FastVideo's DDPPostHocEMACallback (nitrous PostHocEMA on rank 0) and of
// its sharded sibling, for a C++ training loop. Several power-function
// profiles (one per sigma_rel) are updated in one pass on optimizer steps;
// every checkpointEvery counted calls each rank writes its snapshots; at
// the end one sigma_rel is synthesized from them into deployable weights.
//
// Layouts (PostHocCallbackOptions::layout):
//   - kRankZero (default, the DDP lifecycle): rank 0 keeps one full
//     EMA per profile, the other ranks none; snapshots are
//     `{folder}/{i}.{calls}.safetensors`, written by rank 0.
//   - kSharded: every rank keeps its shards of every profile and writes
//     `{folder}/rank_{r:05d}/{i}.{calls}.safetensors`; synthesis runs on
//     each rank's own files and the result is gathered through the
//     communicator, so no rank reads another's files.
// Both give the same deployable weights for one training run (within fp32
// rounding). Every rank counts calls, whatever the layout, so all ranks
// agree on the snapshot steps. All hooks run on the caller's thread; with
// the pinned-host EMA the math runs in the background between calls, and
// calls that write snapshots wait for it.
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardema/averager.h"
#include "shardema/weight_swap.h"
#include "shardema/module_tracking.h"
#include "shardema/sharded_averager.h"
#include "shardema/training_checkpoint.h"

namespace shardema {

namespace offload {
class WorkerPool;
}  // namespace offload

namespace shard {
class Communicator;
}  // namespace shard

enum class PostHocLayout {
  /// Rank 0 holds full EMAs, the other ranks none (nitrous under DDP).
  kRankZero,
  /// Every rank holds its shards of every profile.
  kSharded,
};

struct PostHocCallbackOptions {
  /// One power-function profile per value, each in (0, 1/sqrt(12) =
  /// kMaxSigmaRel = 0.28867513459481287), the sigma_rel of power-function
  /// EMAs with gamma > 0, and distinct; at least 2 (the synthesis needs two
  /// profiles per step), at most kMaxProfiles. Default {0.05, 0.1} (the
  /// seed's).
  std::vector<double> sigmaRels = {0.05, 0.1};
  /// Profiles update on calls n with (n - 1) % updateEvery == 0. Default 1.
  /// Larger: less update work per step (1 / updateEvery of it), but each
  /// update covers more steps, so the profiles follow the weights more
  /// coarsely.
  int64_t updateEvery = 1;
  /// Snapshot when calls % checkpointEvery == 0. Default 5000. Larger:
  /// fewer snapshot files (each one full EMA per profile, written with the
  /// training paused for its copy) but a coarser grid of (step, gamma) for
  /// the synthesis. A checkpoint saved between snapshot calls writes a
  /// resume state (see onSaveCheckpoint).
  int64_t checkpointEvery = 5000;
  /// Where the snapshots go (created if missing). Required: the seed's
  /// default is derived from its trainer's output folder, which we do not
  /// know. Every rank passes the same path.
  std::string checkpointFolder;
  /// Optimizer steps whose 0-based index (globalStep - 1) is below this
  /// are not counted. Default 0.
  int64_t startIter = 0;
  /// sigma_rel synthesized at the end and for validation. Default 0.05.
  double defaultOutputSigma = 0.05;
  /// nitrous's step_size_correction. Default true (the seed's).
  bool stepSizeCorrection = true;
  /// Default kRankZero.
  PostHocLayout layout = PostHocLayout::kRankZero;
  /// Where the EMA lives on a rank that holds one. Default kPinnedHost;
  /// kDevice keeps it beside the parameters, as nitrous does on CUDA.
  EmaStorage storage = EmaStorage::kPinnedHost;
  /// What is averaged and what is copied. Default kEmaPytorch: nitrous
  /// averages floating parameters and buffers alike.
  TrackingPolicy policy = TrackingPolicy::kEmaPytorch;
  /// Update threads (not owned); nullptr: offload::WorkerPool::shared().
  offload::WorkerPool* pool = nullptr;
  /// Pipeline settings of the pinned-host EMA (fence before the next
  /// optimizer step: onBeforeOptimizerStep()).
  AveragerOffloadOptions offload;
  /// Deployable weights: {outputFolder}/{outputPrefix}_sigma_{s}_step_
  /// {calls:09d}.safetensors, s = the sigma with '.' as 'p' (0p05).
  /// outputFolder "" (default) = the folder that holds checkpointFolder
  /// ("." for a bare name). A snapshot folder holds snapshots only, so an
  /// output folder that is the snapshot folder is refused.
  std::string outputFolder;
  std::string outputPrefix = "shardema_ema_final";
  /// dtype of the deployable floating tensors: float32 (default), bfloat16
  /// or float16. Smaller types halve the file and lose precision; the
  /// synthesis itself always accumulates in float64.
  c10::ScalarType outputDtype = c10::ScalarType::Float;
  /// edm2 normalisation of the synthesis weights. Default off (raw solve).
  bool normalize = false;
  /// Bound on the synthesis accumulators (float64) and on each gather
  /// round. Default 64 MiB. Larger: fewer rounds and fewer, larger reads
  /// of every snapshot (faster on slow storage and networks); costs that
  /// much more host memory, once per snapshot reader plus the round.
  int64_t bufferBytes = int64_t{64} << 20;
};

/// This process's place in the job. `comm` (not owned, must outlive the
/// callback's collective calls) is needed when worldSize > 1 for the
/// collective hooks: kSharded's onTrainEnd (gather) and both layouts'
/// validation swap; its rank and world size must be these.
struct PostHocRanks {
  int64_t rank = 0;
  int64_t worldSize = 1;
  shard::Communicator* comm = nullptr;
  /// kSharded under HSDP: the ranks that hold the same shards as this one
  /// (the device mesh's replicate dimension; not owned, must outlive the
  /// callback's collective calls), or nullptr (no replicas, default). Its
  /// rank 0, the first replica, alone keeps the profiles and writes the
  /// files (snapshots, resume states, deployable weights) into the one
  /// snapshot folder of its shard group; the other replicas keep no EMA,
  /// count calls as it does, and take the synthesized EMA from it for the
  /// validation swap. `rank`, `worldSize` and `comm` are the shard group's.
  shard::Communicator* replicas = nullptr;
};

class PostHocCallback {
 public:
  /// Validates every option and `ranks` (c10::ValueError naming the field,
  /// its range and the value).
  explicit PostHocCallback(PostHocCallbackOptions options, PostHocRanks ranks = {});
  ~PostHocCallback();
  PostHocCallback(const PostHocCallback&) = delete;
  PostHocCallback& operator=(const PostHocCallback&) = delete;

  /// Every rank passes its (replicated, DDP-style) module, which must
  /// outlive the callback. kRankZero: rank 0 tracks all of it.
  /// kSharded: each rank tracks its FSDP2 rows of every tensor
  /// (shardsFromFullTensors with kFsdp2). Then resumes from the snapshots
  /// at the calls queued by onLoadCheckpoint, if any.
  void onFitStart(torch::nn::Module& module);
  /// As above, for a module known only by its tensors (a Python module):
  /// every parameter and buffer with the role options.policy gives it, as
  /// trackModule() returns them. The handles must outlive the callback.
  void onFitStart(std::vector<TrackedTensor> moduleTensors);
  /// kSharded only: this rank's live local shards (every spec for
  /// ranks.worldSize; e.g. views of FSDP1 flat shards or FSDP2 locals).
  /// `wholeReplicated`: for each kReplicated shard (a tensor every rank
  /// holds whole, such as a buffer beside FSDP2 parameters), that whole
  /// tensor under the shard's name; the validation swap gathers the EMA
  /// rows of those into it, so every rank swaps in the same full values
  /// (without it, each rank would swap only its own rows). A shard with
  /// splitDim > 0 (tensor parallelism's piece) is averaged, snapshotted and
  /// swapped as the piece it is; its snapshots record the split
  /// (SnapshotInfo::splitDims), so the synthesis of the folder and the
  /// deployable weights give the tensor in its own shape.
  void onFitStart(std::vector<LocalShard> shards,
                  std::vector<TrackedTensor> wholeReplicated = {});

  /// After each training batch; acts only when an optimizer step just
  /// happened (end of an accumulation window or the epoch's last batch, as
  /// EmaCallback). Steps with globalStep - 1 < startIter are not counted.
  /// A counted step increments calls() on every rank, updates this rank's
  /// profiles (step = calls) and, when calls % checkpointEvery == 0, waits
  /// for the math and writes this rank's snapshots. Returns whether the
  /// step was counted. The first counted call of a run that did not resume
  /// refuses (c10::ValueError naming it) a snapshot folder that already
  /// holds snapshots: another run's would join this one's synthesis.
  bool onTrainBatchEnd(int64_t globalStep, int64_t batchIdx, int64_t accumulateGradBatches,
                       bool isLastBatch);
  /// Before every optimizer step (Averager::fence); see EmaCallback.
  void onBeforeOptimizerStep();
  /// Blocks until the EMA math is done; rethrows a background error.
  void wait();

  /// The callback's resume state: metadata "shardema.posthoc.calls" (the
  /// seed's {"calls"}). The EMAs themselves are on disk: the snapshots at
  /// calls(), or, when calls() has none (a save between snapshot calls),
  /// a resume state this call writes (it waits for the math first): each
  /// rank that holds an EMA writes its profiles to
  /// `{snapshotFolder()}/resume/{i}.{calls}.safetensors`, a folder the
  /// synthesis does not read. Every rank calls it (each writes its own).
  /// A resume file per checkpoint stays until removed with its checkpoint.
  void onSaveCheckpoint(TrainingCheckpoint& checkpoint);
  /// Reads the calls back. Before onFitStart it is queued; after it the
  /// EMAs are reloaded at once: each profile's snapshot at that call, else
  /// its resume file, so training goes on bit for bit as if it had not
  /// stopped. A missing or mismatched file (another sigma_rel, world size
  /// or shard layout) is a c10::ValueError naming it. Then each rank that
  /// holds an EMA leaves in its snapshot folder what the uninterrupted run
  /// held at that call, the snapshots on the checkpointEvery grid, so the
  /// synthesis of a resumed or extended run is the uninterrupted run's:
  /// the final snapshot of a run that ended at that call off the grid
  /// (extending a finished run) moves into resumeFolder(), where a second
  /// resume from the same checkpoint finds it, and snapshots past that
  /// call (of a run that went further) move into
  /// `{snapshotFolder()}/superseded/resumed_at_{calls}` (`_2`, ... for a
  /// repeated resume). Moved, never deleted; one warning names them.
  /// Assumes the run that wrote the folder had the same checkpointEvery.
  void onLoadCheckpoint(const TrainingCheckpoint& checkpoint);

  /// Collective when worldSize > 1. Synthesizes defaultOutputSigma at the
  /// newest snapshot (not after calls()) and swaps it into the tracked
  /// floating tensors (integer/bool ones stay live). kSharded: each rank
  /// synthesizes its own shards, the ranks check they solved the same
  /// system, and with a module (replicated on every rank) the rows are
  /// gathered to every rank so each swaps in the whole EMA; with LocalShards
  /// each rank swaps its shards (a tensor-parallel piece, LocalShard::
  /// splitDim, in its own layout). With replicas (HSDP) the first replica
  /// does so and broadcasts what each of its ranks swaps in to the same
  /// rank of the other replicas. kRankZero: rank 0 synthesizes and
  /// broadcasts. Returns false and changes nothing while no snapshot exists
  /// yet. A failure on any rank fails every rank, with the raw weights in
  /// place.
  bool onValidationStart();
  /// Puts the raw values back (no-op when nothing was swapped).
  void onValidationEnd();
  bool emaSwappedIn() const { return swap_ != nullptr; }

  /// End of training; collective for kSharded when worldSize > 1. Writes a
  /// final snapshot unless calls() is on a boundary, synthesizes
  /// defaultOutputSigma at step calls() and writes the deployable weights.
  /// Returns their path on the rank that wrote them (rank 0), "" on the
  /// others and when no call was counted (nothing to synthesize). With
  /// replicas (HSDP) only the first replica's ranks take part; the others
  /// return "" at once, as the other ranks of kRankZero do. A tensor-
  /// parallel piece (LocalShard::splitDim) is written in its own shape.
  std::string onTrainEnd();

  /// Counted optimizer steps so far (every rank).
  int64_t calls() const { return calls_; }
  const PostHocCallbackOptions& options() const { return options_; }
  /// Whether this rank keeps EMA storage (rank 0, or any rank if sharded;
  /// under HSDP only the first replica's ranks).
  bool holdsEma() const;
  /// This rank's EMAs (profile p = sigmaRels[p]); c10::Error before
  /// onFitStart. Empty shard list on ranks > 0 of kRankZero and on the
  /// replicas after the first.
  const ShardedAverager& averager() const;
  /// Where this rank's snapshots go: checkpointFolder, or its rank_NNNNN
  /// subfolder for kSharded.
  std::string snapshotFolder() const;
  /// Where this rank's resume states go: snapshotFolder()/resume.
  std::string resumeFolder() const;

  /// "{prefix}_sigma_0p05_step_000012345.safetensors" (the sigma printed
  /// as Python's str() would, '.' replaced by 'p').
  static std::string deployableFileName(const std::string& prefix, double sigmaRel, int64_t calls);

 private:
  void build(std::vector<LocalShard> shards, std::vector<TrackedTensor> full);
  void resumeAt(int64_t calls);
  void writeSnapshots();
  void writeProfiles(const std::string& folder);
  bool swapInRankZero();
  bool swapInSharded();
  std::unordered_map<std::string, at::Tensor> synthesizedSwapValues();
  void checkSwapValues(const std::unordered_map<std::string, at::Tensor>& values) const;
  void shareWithReplicas(std::unordered_map<std::string, at::Tensor>& values,
                         const std::string& ownError);
  std::map<std::string, int64_t> splitDims() const;
  void keepRawForValidation();
  void swapInValues(const std::unordered_map<std::string, at::Tensor>& values);
  std::vector<at::Tensor> piecesInLayoutOrder(
      const std::vector<std::pair<std::string, at::Tensor>>& tensors) const;
  void checkFolderIsFresh() const;
  std::string deployablePath() const;
  static std::string outputFolderOf(const PostHocCallbackOptions& options);
  std::string finishRankZero();
  std::string finishSharded();

  PostHocCallbackOptions options_;
  PostHocRanks ranks_;
  int64_t calls_ = 0;
  // The global step last seen (a step that does not advance is skipped)
  // and the newest call with snapshots on disk (0: none yet).
  int64_t lastGlobalStep_ = 0;
  int64_t newestSnapshot_ = 0;
  std::optional<int64_t> queuedCalls_;
  std::unique_ptr<ShardedAverager> averager_;
  // What the validation swap writes: the full module tensors on every rank
  // (kRankZero, and kSharded built from a module, whose every rank
  // holds the whole replicated model), or this rank's local shards
  // (kSharded built from LocalShards).
  std::vector<TrackedTensor> swapTargets_;
  bool swapWholeTensors_ = false;
  // kSharded from LocalShards: the kReplicated shards whose whole tensors
  // (in swapTargets_) take gathered values in the validation swap.
  std::vector<std::string> gatheredForSwap_;
  // The validation swap (weight_swap.h), or null.
  std::unique_ptr<WeightSwap> swap_;
};

}  // namespace shardema
