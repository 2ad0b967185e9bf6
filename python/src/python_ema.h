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

#include "shardema/offload/pipeline_stats.h"
#include "shardema/shard/communicator.h"
#include "shardema/sharded_averager.h"

namespace shardema::python {

/// Resume state of one rank: its EMA tensors (local shapes, clones) and the
/// Averager's metadata (step, schedule, roles...) plus the rank, world size
/// and layout fingerprint it belongs to.
struct RankState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> metadata;
};

/// The tensor a module holds (the nn.Parameter or buffer as tracked) of a
/// shard cut from it by shardsFromFullTensors(kind): what update() watches
/// for replacement. Undefined tensor: none (FSDP2 DTensors, local shards).
struct SourceOwner {
  at::Tensor tensor;
  std::optional<shard::LayoutKind> kind;
  /// The tensor whose requires_grad decides, at each update, whether a
  /// kAverageIfTrainable shard is averaged or copied: the parameter (a
  /// DTensor one too). The shard's local cannot say: a view cut from a
  /// parameter keeps requiring grad after the parameter is frozen, and a
  /// DTensor's local tensor never requires grad. Undefined: the local's own
  /// flag decides (local shards given by hand).
  at::Tensor trainable;
};

class PythonEma {
 public:
  /// `wholeTensors` are the full tensors of a replicated model whose EMA is
  /// split over ranks (layout "replicated" with more than one rank): the
  /// swap writes the gathered EMA into them. Empty otherwise: the swap
  /// writes each rank's local shards.
  PythonEma(std::unique_ptr<shard::Communicator> comm, std::vector<LocalShard> shards,
            std::vector<TrackedTensor> wholeTensors, AveragerOptions options,
            std::string layoutName, std::vector<SourceOwner> owners = {});
  ~PythonEma();

  /// step: the 1-based optimizer step; nullopt counts calls (step() + 1).
  /// Refused inside a swap. A tracked tensor whose data was replaced
  /// (`p.data = t`) is followed when its dtype, shape and device are the
  /// same (takeFollowed() names it), refused naming it otherwise.
  bool update(std::optional<int64_t> step);
  /// Before update(): `trainable[k]` is the requires_grad, now, of the k-th
  /// parameter given as a SourceOwner::trainable (in shard order). Each such
  /// kAverageIfTrainable shard is averaged while it is true and copied
  /// otherwise (freezing and unfreezing during training, VersatIL's rule).
  void mirrorTrainable(const std::vector<bool>& trainable);
  /// Tracked tensor `index` (construction order) was replaced by
  /// `replacement` (a new nn.Parameter): followed, or c10::ValueError
  /// naming what changed, as in update().
  void rebind(size_t index, const at::Tensor& replacement);
  /// The names followed since the last call (for a Python warning).
  std::vector<std::string> takeFollowed();
  void fence() { averager_->fence(); }
  void wait() { averager_->wait(); }
  int64_t step() const { return averager_->step(); }
  double lastDecay() const { return averager_->averager().lastDecay(); }
  int64_t rank() const { return averager_->rank(); }
  int64_t worldSize() const { return averager_->worldSize(); }
  /// "single", "replicated", "rank0", "fsdp2" or "local_shards".
  const std::string& layout() const { return layoutName_; }
  /// The tracked names, in construction order.
  std::vector<std::string> names() const { return averager_->averager().names(); }
  /// One tensor's EMA of `profile`, in its local shape (a clone). Waits.
  at::Tensor ema(const std::string& name, int profile) const;
  /// This rank's EMA pieces by name (1-D clones, layout order), no
  /// communication. Waits.
  std::vector<std::pair<std::string, at::Tensor>> localEma() const;
  /// What the background pipeline did so far (zeros for storage kDevice).
  offload::PipelineStats offloadStats() const { return averager_->averager().offloadStats(); }

  /// The EMA into the model (local shards, and whole tensors when
  /// replicated; collective then); swapIn keeps the raw values to put back
  /// with swapOut, and puts them back itself before rethrowing when the
  /// writing fails (a replicated swap's gather). swapIn while swapped is an
  /// error.
  void copyTo();
  void swapIn();
  void swapOut();
  bool swapped() const { return !raw_.empty(); }

  /// Loads full tensors (global names and shapes, e.g. a checkpoint's
  /// state dict) into this rank's EMA: each shard takes its range. Names
  /// not tracked are ignored, tracked ones missing keep their EMA.
  LoadReport loadFullValues(const std::vector<std::pair<std::string, at::Tensor>>& full);
  /// Loads this rank's own pieces (global names, local shapes: what a
  /// Shard(0) DTensor's to_local() holds) into its EMA, no communication.
  /// Names not tracked are ignored, tracked ones missing keep their EMA;
  /// a piece of another size is a ValueError naming it.
  LoadReport loadLocalValues(const std::vector<std::pair<std::string, at::Tensor>>& local);

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
  /// Collective: rank 0 streams deployable safetensors to `path`.
  void exportWeights(const std::string& path, c10::ScalarType dtype);
  /// Collective: the full EMA tensors on rank 0 (rank0Only) or on every
  /// rank, an empty list on the others; `names`: just those (every rank
  /// the same), nullopt: all.
  std::vector<std::pair<std::string, at::Tensor>> fullStateDict(
      bool rank0Only, const std::optional<std::vector<std::string>>& names = std::nullopt);

 private:
  struct Owner {
    at::Tensor tensor;
    std::optional<shard::LayoutKind> kind;
    // What the shard was cut from: a change is a replaced tensor.
    const c10::StorageImpl* storage = nullptr;
    int64_t offset = 0;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::vector<int64_t> sizes;
    // SourceOwner::trainable was given: the Python side passes that
    // parameter's requires_grad to mirrorTrainable() at each update. The
    // engine keeps no reference to the parameter, strong or weak: torch's
    // swap_tensors (FSDP2's module.to(), Lightning's strategies) refuses to
    // swap a parameter whose TensorImpl is referenced from elsewhere.
    bool decidesTrainable = false;
    static Owner of(const at::Tensor& tensor, std::optional<shard::LayoutKind> kind);
  };
  void followReplacedData();
  std::string stateDifference(const RankState& state) const;
  void writeEmaIntoModel();
  std::unique_ptr<shard::Communicator> comm_;
  std::unique_ptr<ShardedAverager> averager_;
  std::vector<TrackedTensor> wholeTensors_;
  std::string layoutName_;
  // The raw values during a swap: local shards first, then whole tensors.
  std::vector<at::Tensor> raw_;
  std::vector<Owner> owners_;  // one per shard, or none
  std::vector<std::string> followed_;
};

}  // namespace shardema::python
