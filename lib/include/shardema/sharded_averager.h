#pragma once
// ShardedAverager: the EMA of this rank's shards of a sharded (FSDP1, FSDP2)
// or replicated model (DESIGN.md section 3). Each rank tracks exactly the
// elements it owns, described by a shard::ShardSpec per tensor; the EMA is
// elementwise, so update() never communicates and the union of every rank's
// EMA equals the EMA a single process would keep of the full tensors. A
// tensor the ranks do not keep equal (kPerRank: BatchNorm statistics under
// DDP and FSDP2) is held whole by every rank, each the EMA of its own copy;
// rank 0's is the one gathers, files and exports take.
// Full tensors exist only when asked for (fullStateDict, exportWeights) or offline
// (sharded_checkpoint.h: exportCheckpoint over a saved folder).
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shardema/averager.h"
#include "shardema/shard/flat_param_layout.h"
#include "shardema/shard/gather.h"
#include "shardema/shard/shard_layout.h"
#include "shardema/shard/shard_spec.h"
#include "shardema/tracking_policy.h"

namespace shardema {

namespace shard {
class Communicator;
}  // namespace shard

/// One tensor of this rank: its local elements and how the global tensor is
/// split. `local` is a handle to the live local shard (e.g. FSDP2's local
/// DTensor view, a view into FSDP1's flat shard): read at every update,
/// written only by copyTo. Any shape; numel must be this rank's
/// spec.heldRange() size (the whole tensor under kPerRank) and dtype the
/// spec's.
struct LocalShard {
  at::Tensor local;
  shard::ShardSpec spec;
  TrackRole role = TrackRole::kAverage;
  /// The forward pass changes it (a buffer such as BatchNorm statistics):
  /// read inside update() rather than in the background (see
  /// TrackedTensor::changesInForward). shardsFromFullTensors carries it
  /// over. Default false.
  bool changesInForward = false;
  /// The version counter writes to the tensor bump when it is not the
  /// local's own (see TrackedTensor::writeVersion): a DTensor's.
  std::optional<c10::VariableVersion> writeVersion = std::nullopt;
  /// The tensor's other names: a tied weight is one tensor under several
  /// state_dict keys (`head.weight = emb.weight`), tracked once under
  /// spec.name. fullStateDict and exportWeights give it under each of them
  /// too, as a copy of its own (safetensors refuses two names over one
  /// storage), so a strict load_state_dict of an export into the model
  /// finds every key; checkpoints record them (RankManifest::aliases).
  /// Unique across the job's names and aliases. Default none.
  std::vector<std::string> aliases = {};
  /// false: no state_dict key holds it (PyTorch's register_buffer(...,
  /// persistent=False), e.g. a rotary embedding's inv_freq). The EMA keeps
  /// it like any tensor (swaps and resumes restore it), but the full
  /// state dict and the deployable export are the model's state_dict()
  /// keys, so fullStateDict (without `only`) and exportWeights leave it
  /// out and a strict load of them finds no unexpected key. Checkpoints
  /// record it (RankManifest::nonPersistent), so exportCheckpoint leaves it
  /// out too. Default true.
  bool persistent = true;
  /// 0 (default): `local` holds this rank's range of the spec's elements in
  /// their order (FSDP2's rows, a replicated tensor's rows, an FSDP1 range).
  /// d > 0: tensor parallelism's Shard(d): `local` is torch.chunk's piece
  /// along dim d (a DTensor's to_local(), in its own shape), and the spec
  /// describes the tensor with dim d moved first, whose rows of this rank
  /// hold the same elements in another order. update, swaps and localEma
  /// work on the piece as it is; fullStateDict and exportWeights move dim d
  /// of each piece first and the assembled tensor's back, so they give the
  /// tensor in its own shape. Needs local.dim() == the spec's rank and
  /// local's other dims equal to the spec's (c10::ValueError naming the
  /// tensor). Per-rank checkpoint files cannot record it: saveCheckpoint
  /// refuses such a shard.
  int64_t splitDim = 0;
};

/// A full tensor the EMA does not track, which exportWeights writes beside
/// the EMA's: the model's own current value of what the EMA leaves out (a
/// frozen weight under trainable-only tracking, a buffer, an ignored name),
/// so that the export loads strict into the plain model (Python's
/// export_weights(include_untracked=True)).
struct UntrackedTensor {
  /// Its state_dict key; unique across the export's names.
  std::string name;
  /// The full tensor, any device and layout; read on the root only, a
  /// piece at a time, floating ones written as the export's dtype.
  at::Tensor value;
  /// The exported EMA tensor (its first name) it is written right before,
  /// so the file order is the model's state_dict() order; empty: after the
  /// EMA's last tensor.
  std::string before;
};

class ShardedAverager {
 public:
  /// Validates every shard (spec invariants, every spec for `worldSize`
  /// ranks, rank in [0, worldSize), unique names, local numel == the rank's
  /// range size, local dtype == spec dtype: c10::ValueError naming the
  /// tensor), then builds the Averager over the local shards under their
  /// global names. An empty shard list is allowed (a rank that owns
  /// nothing). The world size is a parameter rather than read off the specs
  /// so that such a rank still knows its job's size. Does not block.
  ShardedAverager(int64_t rank, int64_t worldSize, std::vector<LocalShard> shards,
                  AveragerOptions options = {});
  ShardedAverager(const ShardedAverager&) = delete;
  ShardedAverager& operator=(const ShardedAverager&) = delete;
  ShardedAverager(ShardedAverager&&) noexcept = default;
  ShardedAverager& operator=(ShardedAverager&&) noexcept = default;
  ~ShardedAverager() = default;

  int64_t rank() const { return rank_; }
  /// Shared by every spec; the worldSize passed to the shard builders.
  int64_t worldSize() const { return worldSize_; }
  /// Every tensor's spec, in attach order (what checkpoints record).
  const shard::ShardLayout& layout() const { return layout_; }
  /// This rank's live local shards, attach order.
  const std::vector<LocalShard>& shards() const { return shards_; }
  /// LocalShard::aliases of the tensors that have any, by name.
  std::map<std::string, std::vector<std::string>> aliases() const;
  /// The names of the shards that are not persistent (LocalShard::persistent).
  std::set<std::string> nonPersistent() const;
  /// The shard `name` is now `local` (its tensor was replaced by one of the
  /// same shape, dtype and device): Averager::rebindSource, whose
  /// c10::ValueError names what differs.
  /// `newWriter` as Averager::rebindSource's (LocalShard::writeVersion is
  /// dropped with it).
  void rebindLocal(const std::string& name, const at::Tensor& local, bool newWriter = false);
  /// The one rule of a replaced tensor (its module now holds `full` under
  /// `name`: a new nn.Parameter, `p.data = t`, a submodule swapped for one
  /// of the same shape): from the next update on the EMA reads this rank's
  /// piece of `full`, cut as the spec's kind cuts it (kFsdp2/kReplicated:
  /// its rows; kRankZero: all of it on rank 0). `full` must be a plain dense
  /// contiguous tensor of the spec's shape, the shard's dtype and device:
  /// c10::ValueError naming the tensor and what differs otherwise (a tensor
  /// subclass such as a DTensor: the model was sharded after the EMA was
  /// built), before anything changes. kFsdp1 pieces and splitDim shards
  /// cannot be cut from a full tensor: refused naming the tensor. An update
  /// in flight keeps reading the old tensor until fence(). Does not block.
  void followReplaced(const std::string& name, const at::Tensor& full);

  /// Averager::update / fence / wait of the local shards (no communication).
  bool update(int64_t step) { return averager_.update(step); }
  void fence() { averager_.fence(); }
  void wait() { averager_.wait(); }
  int64_t step() const { return averager_.step(); }

  /// The Averager underneath: EMA storage in local shapes, state(), options.
  Averager& averager() { return averager_; }
  const Averager& averager() const { return averager_; }

  /// This rank's EMA pieces as 1-D contiguous CPU tensors in layout order
  /// (numel = the rank's heldRange size: the whole of a kPerRank tensor,
  /// this rank's own EMA of it; float32 for averaging roles, the source
  /// dtype for copies) of `profile` (Averager's; c10::IndexError for one
  /// that does not exist). Waits for an update in flight. Views of our
  /// storage for the kPinnedHost storage; host copies for kDevice.
  std::vector<at::Tensor> localEma(int profile = 0) const;

  /// Collective (every rank calls it): the full EMA tensors, global shapes
  /// (a splitDim shard's: its own, dim 0 moved back; a kPerRank one's:
  /// rank 0's), on the receiving
  /// rank(s) of `options` (shard::gatherFull), each followed by a copy under
  /// each of its aliases. When this
  /// rank's localEma() throws (e.g. a failed background update), it
  /// joins with GatherOptions::localError, so every rank fails at once.
  /// Without `only`: the persistent tensors (LocalShard::persistent), the
  /// model's state_dict() keys. `only`: just these names, tracked names or
  /// aliases, non-persistent ones too (layout order,
  /// under the names asked for; every rank the same names; another name is
  /// a c10::IndexError naming it, on every rank before any exchange), e.g.
  /// the replicated buffers of an FSDP2 model whose parameters a caller
  /// reads as local shards. `profile`: which EMA (every rank the same).
  std::vector<std::pair<std::string, at::Tensor>> fullStateDict(
      shard::Communicator& comm, shard::GatherOptions options = {},
      const std::optional<std::vector<std::string>>& only = std::nullopt, int profile = 0) const;

  /// Collective: streams the full EMA (kPerRank tensors: rank 0's; the
  /// persistent tensors, LocalShard::persistent) to
  /// options.root (>= 0), which writes
  /// one deployable safetensors file at `path` tensor by tensor
  /// (TensorFileWriter), never holding more than options.bufferBytes of
  /// gathered data; a tensor with aliases is written again under each, right
  /// after it, from one full copy the root holds while it writes them (the
  /// file holds its bytes once per name), and a splitDim shard's tensor is
  /// assembled whole on the root the same way and written in its own order
  /// a few rows at a time: beyond the gather's buffer, the root holds at
  /// most one full tensor, the other ranks a reordered copy of their own
  /// piece. Floating tensors are written as
  /// `outputDtype` (float32,
  /// bfloat16 or float16); integer/bool copies keep their dtype. Metadata:
  /// shardema.kind=deployable_weights, shardema.step, shardema.schedule
  /// (the schedule of `profile`, the EMA written; every rank the same).
  /// Metadata: also format=pt (safetensors' key, which transformers'
  /// loader requires).
  /// With `maxShardBytes` (>= 1), `path` is a folder and the tensors go
  /// into files of at most that many bytes of data, laid out as Hugging
  /// Face's save_pretrained lays them out (TensorFolderWriter:
  /// model-00001-of-0000N.safetensors and model.safetensors.index.json, or
  /// one model.safetensors when all fit; a tensor larger than the limit gets
  /// a file of its own), still streamed tensor by tensor on the root.
  /// Crash-safe: a failure leaves any old file at `path` (the old folder's
  /// set) as it was. If the
  /// root cannot create the file, or any rank's localEma() throws,
  /// every rank fails (c10::Error naming it) before anything moves; when
  /// the root's append/commit fails, every rank fails after the gather.
  /// `untracked` (read on the root; the others may pass none): written
  /// too, each right before the EMA tensor it names, into the same file or
  /// the same folder's split (the split counts them like the EMA's), and
  /// listed in the metadata under shardema.from_model (a JSON list of
  /// names); the root holds them, nothing more. A name the export already
  /// holds, or a `before` naming no exported tensor, is a c10::ValueError
  /// on the root (the others fail as when it cannot create the file).
  /// Blocks.
  void exportWeights(shard::Communicator& comm, const std::string& path,
                     c10::ScalarType outputDtype = c10::ScalarType::Float,
                     shard::GatherOptions options = {},
                     std::optional<int64_t> maxShardBytes = std::nullopt,
                     int profile = 0,
                     const std::vector<UntrackedTensor>& untracked = {}) const;

 private:
  // localEma() with each splitDim piece in its spec's element order (what
  // the gathers assemble).
  std::vector<at::Tensor> piecesInSpecOrder(int profile) const;

  int64_t rank_ = 0;
  int64_t worldSize_ = 0;
  std::vector<LocalShard> shards_;
  shard::ShardLayout layout_;
  Averager averager_;
};

/// Local shards of full module tensors for a per-tensor layout (kFsdp2,
/// kReplicated, kRankZero, kPerRank): each local is a view of `rank`'s rows
/// of the full tensor (dim-0 rows [min(r*c, d0), min((r+1)*c, d0)) for FSDP2
/// and replicated, everything or nothing for rank 0 full copy, the whole
/// tensor on every rank for per-rank), which is what FSDP2's local DTensor
/// view holds; 0-dim tensors belong to rank 0 (per-rank: to every rank). The
/// spec dtype, role and changesInForward are the tensor's. `full` must be contiguous
/// (c10::ValueError naming the tensor); kFsdp1 is refused (use shardsFromFlatParam).
std::vector<LocalShard> shardsFromFullTensors(const std::vector<TrackedTensor>& full,
                                              shard::LayoutKind kind, int64_t rank,
                                              int64_t worldSize);

/// Local shards of one FSDP1 unit on `rank`: views into `localFlatShard`
/// (the rank's 1-D flat shard, FlatParamLayout::shardNumel() elements of its
/// dtype, padding included) at each member's localOffset, with the members'
/// kFsdp1 specs. Padding is never tracked. c10::ValueError for a flat shard
/// of the wrong size, dtype or rank.
std::vector<LocalShard> shardsFromFlatParam(const shard::FlatParamLayout& layout,
                                            const at::Tensor& localFlatShard, int64_t rank,
                                            TrackRole role = TrackRole::kAverage);

}  // namespace shardema
