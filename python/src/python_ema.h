#pragma once
// PythonEma: the one C++ type behind shardema.EMA (shardema._C.Ema). A
// ShardedAverager over this rank's local shards plus the communicator of the
// job, and what a Python training loop asks of them together: update by
// call count, swap the EMA into the model and back, resume state as plain
// tensors, the collective checkpoint / export / gather. Each method is bound
// under its own name in snake_case (bind_ema.cpp, API_NAMES.md). No math
// here: every figure comes from the Averager and the shard/ collectives.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model_watch.h"
#include "shardema/offload/pipeline_stats.h"
#include "shardema/shard/communicator.h"
#include "shardema/sharded_averager.h"
#include "shardema/weight_swap.h"

namespace shardema::python {

/// Resume state of one rank: its EMA tensors (local shapes, clones) and the
/// Averager's metadata (step, schedule, roles...) plus the rank, world size
/// and layout fingerprint it belongs to.
struct RankState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> metadata;
};

/// shardema.EMA's options (shardema._C.EmaOptions): the Averager's, with
/// SourceWrites::kAdaptive always (the Python front's rule, averager.h),
/// and the timeout of the collectives.
struct PythonEmaOptions {
  AveragerOptions averager;
  /// Seconds a collective (gather, checkpoint agreement) waits for the
  /// other ranks before failing naming them. Default 300.
  double timeoutSeconds = 300.0;
};

/// A parameter whose requires_grad decides, at each update, whether shard
/// `shard` (kAverageIfTrainable) is averaged or copied: the module's
/// parameter, a DTensor one too. Neither a view cut from a parameter nor a
/// DTensor's local tensor follows its flag. Its version counter is the one
/// writes to the shard bump (the DTensor's; a plain parameter's is its
/// rows' own).
struct Decider {
  size_t shard = 0;
  at::Tensor parameter;  // read at construction only, never kept
};

class PythonEma {
 public:
  /// `wholeTensors` are the full tensors of a replicated model whose EMA is
  /// split over ranks (layout "replicated" with more than one rank): the
  /// swap writes the gathered EMA into them. Empty otherwise: the swap
  /// writes each rank's local shards. `watch`: what checkModel() checks of
  /// the model (empty for an EMA of named tensors or local shards).
  PythonEma(std::unique_ptr<shard::Communicator> comm, std::vector<LocalShard> shards,
            std::vector<TrackedTensor> wholeTensors, PythonEmaOptions options,
            std::string layoutName, ModelWatch watch, const std::vector<Decider>& deciders);
  ~PythonEma();

  /// With the GIL held, before every update, swap and copy: the model is
  /// still what the EMA was built from (ModelWatch). A tensor replaced by
  /// one of the same shape, dtype and device is followed
  /// (ShardedAverager::followReplaced, the lib's rule; its name returned,
  /// for a warning), anything else refused naming it (ValueError). A
  /// changed structure (a submodule replaced, a tensor added or removed, a
  /// tied weight untied) asks `replan` (the package's planner:
  /// EMA._replan), which returns (slots, edges, counted, deciders,
  /// followed[, frozen]) for a new watch, or raises. A parameter left out
  /// for being frozen (trainable_only) that requires grad now is refused
  /// naming it (ValueError), first. Then the requires_grad of each decider
  /// is mirrored into its shard. `api`: the Python call the user made
  /// ("shardema.EMA.export_weights"), which every refusal starts with.
  /// Every call of the EMA that reads or writes the model, or answers for
  /// it (exports, checkpoints, state_dict), runs this one check first.
  std::vector<std::string> checkModel(const py::object& replan,
                                      const std::string& api = "shardema.EMA");
  /// The part of checkModel() that concerns a read answering for the model
  /// from what the EMA holds (exports, checkpoints, state_dict, module): a
  /// tracked tensor that became a DTensor (fully_shard after the EMA) is
  /// refused as checkModel() refuses it, since the answer would be the
  /// plain model's. Nothing is followed or replanned (update() does that;
  /// the EMA's values are still its own).
  void checkModelForRead(const std::string& api) const;
  /// step: the 1-based optimizer step; nullopt counts calls (step() + 1).
  /// Refused inside a swap (weight_swap.h). Call checkModel() first.
  bool update(std::optional<int64_t> step);
  void fence() { averager_->fence(); }
  void wait() { averager_->wait(); }
  int64_t step() const { return averager_->step(); }
  double lastDecay(int profile) const { return averager_->averager().lastDecay(profile); }
  /// The profiles kept: 1 + the options' moreSchedules.
  int numProfiles() const { return averager_->averager().numProfiles(); }
  int64_t rank() const { return averager_->rank(); }
  int64_t worldSize() const { return averager_->worldSize(); }
  /// "single", "replicated", "rank0", "fsdp2", "fsdp1" or "local_shards".
  const std::string& layout() const { return layoutName_; }
  /// The tracked names, in construction order.
  std::vector<std::string> names() const { return averager_->averager().names(); }
  /// One tensor's EMA of `profile`, in its local shape (a clone). Waits.
  at::Tensor ema(const std::string& name, int profile) const;
  /// This rank's EMA pieces of `profile` by name (1-D clones, layout
  /// order), no communication. Waits.
  std::vector<std::pair<std::string, at::Tensor>> localEma(int profile) const;
  /// What the background pipeline did so far (zeros for storage kDevice).
  offload::PipelineStats offloadStats() const { return averager_->averager().offloadStats(); }

  /// The EMA into the model (local shards, and whole tensors when
  /// replicated; collective then); swapIn keeps the raw values to put back
  /// with swapOut, and puts them back itself before rethrowing when the
  /// writing fails (a replicated swap's gather). swapIn while swapped is an
  /// error.
  /// `profile`: which EMA is written (the package checked it).
  void copyTo(int profile);
  void swapIn(int profile);
  void swapOut();
  bool swapped() const { return swap_ != nullptr; }

  /// Loads full tensors (global names and shapes, e.g. a checkpoint's
  /// state dict) into this rank's EMA: each shard takes its range. Names
  /// not tracked are ignored, tracked ones missing keep their EMA.
  /// `profile`: which EMA takes them (the package checked it).
  LoadReport loadFullValues(const std::vector<std::pair<std::string, at::Tensor>>& full,
                            int profile);
  /// Loads this rank's own pieces (global names, local shapes: what a
  /// Shard(0) DTensor's to_local() holds) into its EMA, no communication.
  /// Names not tracked are ignored, tracked ones missing keep their EMA;
  /// a piece of another size is a ValueError naming it.
  LoadReport loadLocalValues(const std::vector<std::pair<std::string, at::Tensor>>& local,
                             int profile);

  RankState stateDict() const;
  /// stateDict()'s structure without the EMA values, so a failed EMA can
  /// be told what loads into it: each tensor an expanded one-element tensor
  /// of its EMA's dtype and local shape (no memory), the metadata as
  /// stateDict()'s at the current progress. Does not wait.
  RankState stateTemplate() const;
  /// Checks rank, world size and layout before anything changes.
  void loadStateDict(const RankState& state);

  /// Collective: the per-rank checkpoint folder (with its manifest).
  void saveCheckpoint(const std::string& folder);
  /// Collective: every rank loads its file; if one fails, all fail and
  /// none changed.
  void loadCheckpoint(const std::string& folder);
  /// Collective: rank 0 streams deployable safetensors of `profile` to
  /// `path` (with maxShardBytes: a folder in Hugging Face's layout), with
  /// the model's `untracked` tensors among them (rank 0's are written).
  void exportWeights(const std::string& path, c10::ScalarType dtype,
                     std::optional<int64_t> maxShardBytes, int profile,
                     const std::vector<UntrackedTensor>& untracked);
  /// Collective: the full EMA tensors on rank 0 (rank0Only) or on every
  /// rank, an empty list on the others; `names`: just those (every rank
  /// the same), nullopt: all.
  std::vector<std::pair<std::string, at::Tensor>> fullStateDict(
      bool rank0Only, const std::optional<std::vector<std::string>>& names, int profile);

 private:
  void mirrorTrainable(const std::vector<bool>& trainable);
  // The lib follows `name` to `full`; the whole tensor of that name (a
  // replicated swap's target) becomes `full`.
  void follow(const std::string& name, const at::Tensor& full);
  bool isSource(const std::string& name, const at::Tensor& full) const;
  std::string stateDifference(const RankState& state) const;
  void writeEmaIntoModel(int profile);
  std::vector<std::pair<std::string, at::Tensor>> modelTargets() const;
  std::unique_ptr<shard::Communicator> comm_;
  std::unique_ptr<ShardedAverager> averager_;
  std::vector<TrackedTensor> wholeTensors_;
  std::string layoutName_;
  // The swap in progress (weight_swap.h), or null.
  std::unique_ptr<WeightSwap> swap_;
  ModelWatch watch_;
  std::vector<size_t> deciderShards_;  // shard of each watch_ decider
};

}  // namespace shardema::python
