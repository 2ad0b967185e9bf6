#include "shardema/sharded_averager.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "sharded_internal.h"
#include "shardema/sharded_checkpoint.h"

namespace shardema {
namespace {

constexpr const char* kShardedApi = "ShardedAverager";

void checkShard(const LocalShard& shard, int64_t rank, int64_t worldSize) {
  const shard::ShardSpec& spec = shard.spec;
  shard::checkShardSpec(spec);
  TORCH_CHECK_VALUE(spec.worldSize() == worldSize, kShardedApi, ": tensor '", spec.name,
                    "' has a spec for ", spec.worldSize(), " ranks but the world size is ",
                    worldSize, "; every spec must describe the same job");
  TORCH_CHECK_VALUE(rank >= 0 && rank < worldSize, kShardedApi, ": rank ", rank,
                    " is outside the world size ", worldSize, " of tensor '", spec.name, "'");
  TORCH_CHECK_VALUE(shard.local.defined(), kShardedApi, ": tensor '", spec.name,
                    "' has an undefined local shard");
  const shard::ElementRange held = spec.heldRange(rank);
  TORCH_CHECK_VALUE(shard.local.numel() == held.size(), kShardedApi, ": tensor '", spec.name,
                    "' has a local shard of ", shard.local.numel(), " elements but rank ", rank,
                    " holds ", held.size(), " (range [", held.begin, ", ", held.end, ") of ",
                    spec.numel(), spec.kind == shard::LayoutKind::kPerRank ? ", per_rank" : "",
                    ")");
  TORCH_CHECK_VALUE(shard.local.scalar_type() == spec.dtype, kShardedApi, ": tensor '", spec.name,
                    "' has a local shard of dtype ", shard.local.scalar_type(),
                    " but its spec says ", spec.dtype);
  if (shard.splitDim == 0) return;
  const int64_t dims = static_cast<int64_t>(spec.globalShape.size());
  TORCH_CHECK_VALUE(shard.splitDim > 0 && shard.splitDim < dims && shard.local.dim() == dims,
                    kShardedApi, ": tensor '", spec.name, "' has splitDim ", shard.splitDim,
                    " but a spec of ", dims, " dims and a local shard of ", shard.local.dim(),
                    "; splitDim must name a dim > 0 of both");
  std::vector<int64_t> moved = shard.local.movedim(shard.splitDim, 0).sizes().vec();
  TORCH_CHECK_VALUE(std::equal(moved.begin() + 1, moved.end(), spec.globalShape.begin() + 1),
                    kShardedApi, ": tensor '", spec.name, "' has a local shard of shape ",
                    shard.local.sizes(), ", which with dim ", shard.splitDim,
                    " moved first does not fit its spec's shape ", spec.globalShape);
}

// Validates before the Averager copies anything, so errors name the shard
// spec problem rather than an Averager one.
std::vector<LocalShard> checkedShards(int64_t rank, std::vector<LocalShard> shards,
                                      int64_t worldSize) {
  std::unordered_set<std::string> names;
  for (const LocalShard& shard : shards) {
    checkShard(shard, rank, worldSize);
    TORCH_CHECK_VALUE(names.insert(shard.spec.name).second, kShardedApi, ": tensor '",
                      shard.spec.name, "' is given twice; names must be unique");
  }
  return shards;
}

shard::ShardLayout layoutOf(const std::vector<LocalShard>& shards) {
  shard::ShardLayout layout;
  for (const LocalShard& shard : shards) layout.specs.push_back(shard.spec);
  return layout;
}

std::map<std::string, std::vector<std::string>> aliasesOf(const std::vector<LocalShard>& shards) {
  std::map<std::string, std::vector<std::string>> aliases;
  for (const LocalShard& shard : shards) {
    if (!shard.aliases.empty()) aliases[shard.spec.name] = shard.aliases;
  }
  return aliases;
}

std::vector<TrackedTensor> trackedOf(const std::vector<LocalShard>& shards) {
  std::vector<TrackedTensor> tracked;
  tracked.reserve(shards.size());
  for (const LocalShard& shard : shards) {
    tracked.push_back(
        TrackedTensor{shard.spec.name, shard.local, shard.role, shard.changesInForward,
                      shard.writeVersion});
  }
  return tracked;
}

// FSDP2 chunk rows of dim 0: derived from rows, not elements, so a tensor
// with a zero inner size ([5, 0]) still gets the rows FSDP2 gives it.
std::pair<int64_t, int64_t> chunkRows(int64_t d0, int64_t rank, int64_t worldSize) {
  const int64_t chunk = (d0 + worldSize - 1) / worldSize;
  return {std::min(rank * chunk, d0), std::min((rank + 1) * chunk, d0)};
}

at::Tensor localRowsOf(const at::Tensor& full, shard::LayoutKind kind, int64_t rank,
                       int64_t worldSize) {
  if (kind == shard::LayoutKind::kPerRank) return full;  // every rank its own, whole
  if (full.dim() == 0) {
    // 0-dim: rank 0 owns the one element; the others an empty piece.
    return rank == 0 ? full : full.reshape({-1}).narrow(0, 1, 0);
  }
  const int64_t d0 = full.size(0);
  if (kind == shard::LayoutKind::kRankZero) {
    return rank == 0 ? full : full.narrow(0, d0, 0);
  }
  const auto [begin, end] = chunkRows(d0, rank, worldSize);
  return full.narrow(0, begin, end - begin);
}

shard::ShardSpec specFor(const TrackedTensor& tensor, shard::LayoutKind kind, int64_t worldSize) {
  const std::vector<int64_t> shape = tensor.source.sizes().vec();
  const c10::ScalarType dtype = tensor.source.scalar_type();
  switch (kind) {
    case shard::LayoutKind::kFsdp2:
      return shard::fsdp2Spec(tensor.name, shape, dtype, worldSize);
    case shard::LayoutKind::kReplicated:
      return shard::replicatedSpec(tensor.name, shape, dtype, worldSize);
    case shard::LayoutKind::kRankZero:
      return shard::rankZeroSpec(tensor.name, shape, dtype, worldSize);
    case shard::LayoutKind::kPerRank:
      return shard::perRankSpec(tensor.name, shape, dtype, worldSize);
    case shard::LayoutKind::kFsdp1:
      break;
  }
  TORCH_CHECK_VALUE(false, "shardsFromFullTensors: tensor '", tensor.name,
                    "': kFsdp1 cannot be cut from a full tensor; use shardsFromFlatParam");
}

}  // namespace

ShardedAverager::ShardedAverager(int64_t rank, int64_t worldSize, std::vector<LocalShard> shards,
                                 AveragerOptions options)
    : rank_(rank),
      worldSize_(worldSize),
      shards_(checkedShards(rank, std::move(shards), worldSize)),
      layout_(layoutOf(shards_)),
      averager_(trackedOf(shards_), std::move(options)) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < worldSize, kShardedApi, ": rank ", rank,
                    " is outside the world size ", worldSize);
  checkTensorAliases(layout_, aliases(), kShardedApi);
}

std::map<std::string, std::vector<std::string>> ShardedAverager::aliases() const {
  return aliasesOf(shards_);
}

std::set<std::string> ShardedAverager::nonPersistent() const {
  std::set<std::string> names;
  for (const LocalShard& shard : shards_) {
    if (!shard.persistent) names.insert(shard.spec.name);
  }
  return names;
}

void ShardedAverager::rebindLocal(const std::string& name, const at::Tensor& local,
                                  bool newWriter) {
  for (LocalShard& shard : shards_) {
    if (shard.spec.name != name) continue;
    averager_.rebindSource(name, local, newWriter);
    shard.local = local;
    if (newWriter) shard.writeVersion = std::nullopt;
    return;
  }
  TORCH_CHECK_INDEX(false, kShardedApi, "::rebindLocal: no tensor '", name, "'");
}

void ShardedAverager::followReplaced(const std::string& name, const at::Tensor& full) {
  const char* api = "ShardedAverager::followReplaced";
  for (LocalShard& shard : shards_) {
    if (shard.spec.name != name) continue;
    TORCH_CHECK_VALUE(full.defined(), api, ": tensor '", name, "' was removed from its module");
    TORCH_CHECK_VALUE(!full.key_set().has(c10::DispatchKey::Python), api, ": tensor '", name,
                      "' was replaced by a tensor subclass (Python dispatch, e.g. a DTensor: ",
                      "the model sharded after the EMA was built); build the EMA after sharding");
    TORCH_CHECK_VALUE(shard.spec.kind != shard::LayoutKind::kFsdp1 && shard.splitDim == 0, api,
                      ": tensor '", name, "' was replaced, and its ",
                      shard.splitDim != 0 ? "tensor-parallel piece" : "FSDP1 flat-shard piece",
                      " cannot be cut from the new tensor; build a new EMA");
    TORCH_CHECK_VALUE(full.layout() == at::kStrided, api, ": tensor '", name,
                      "' was replaced by a ", full.layout(), " tensor; the EMA follows dense ",
                      "tensors only");
    const bool same = full.scalar_type() == shard.spec.dtype &&
                      full.sizes() == c10::IntArrayRef(shard.spec.globalShape) &&
                      full.device() == shard.local.device();
    TORCH_CHECK_VALUE(same, api, ": tensor '", name, "' changed after the EMA was built, from ",
                      shard.spec.dtype, " ", c10::IntArrayRef(shard.spec.globalShape), " on ",
                      shard.local.device(), " to ", full.scalar_type(), " ", full.sizes(), " on ",
                      full.device(),
                      ": the EMA cannot follow it (convert or move the model before building "
                      "the EMA)");
    TORCH_CHECK_VALUE(full.is_contiguous(), api, ": tensor '", name,
                      "' was replaced by a non-contiguous tensor; the EMA follows contiguous ones");
    rebindLocal(name, localRowsOf(full.detach(), shard.spec.kind, rank_, worldSize_),
                /*newWriter=*/true);
    return;
  }
  TORCH_CHECK_INDEX(false, api, ": no tensor '", name, "'");
}

std::vector<at::Tensor> ShardedAverager::localEma(int profile) const {
  std::vector<at::Tensor> pieces;
  pieces.reserve(shards_.size());
  for (const auto& [name, ema] : averager_.emaTensors(profile)) {
    pieces.push_back(ema.is_cpu() ? ema.contiguous().reshape({-1})
                                  : ema.reshape({-1}).to(c10::Device(c10::kCPU)));
  }
  return pieces;
}

std::vector<at::Tensor> ShardedAverager::piecesInSpecOrder(int profile) const {
  std::vector<at::Tensor> pieces = localEma(profile);
  for (size_t i = 0; i < shards_.size(); ++i) {
    const LocalShard& shard = shards_[i];
    pieces[i] = detail::rangeOfHeld(shard.spec, rank_, pieces[i]);
    if (shard.splitDim == 0) continue;
    pieces[i] =
        pieces[i].view(shard.local.sizes()).movedim(shard.splitDim, 0).contiguous().view({-1});
  }
  return pieces;
}

std::vector<std::pair<std::string, at::Tensor>> ShardedAverager::fullStateDict(
    shard::Communicator& comm, shard::GatherOptions options,
    const std::optional<std::vector<std::string>>& only, int profile) const {
  // Before any exchange, on every rank (each asks for the same profile).
  averager_.schedule(profile);
  std::vector<at::Tensor> pieces;
  try {
    pieces = piecesInSpecOrder(profile);
  } catch (...) {
    // A background failure rethrown here: join the gather's first exchange
    // with it, so every rank fails at once naming this one.
    options.localError = detail::currentErrorMessage();
  }
  // Each tensor gathered once, then given under each name asked for.
  std::vector<std::vector<std::string>> namesOf(shards_.size());
  if (only) {
    std::unordered_map<std::string, size_t> index;
    for (size_t i = 0; i < shards_.size(); ++i) {
      index[shards_[i].spec.name] = i;
      for (const std::string& alias : shards_[i].aliases) index[alias] = i;
    }
    const std::unordered_set<std::string> wanted(only->begin(), only->end());
    for (const std::string& name : wanted) {
      TORCH_CHECK_INDEX(index.count(name), kShardedApi, "::fullStateDict: no tensor '", name,
                        "' (neither a tracked name nor an alias)");
    }
    for (size_t i = 0; i < shards_.size(); ++i) {
      if (wanted.count(shards_[i].spec.name)) namesOf[i].push_back(shards_[i].spec.name);
      for (const std::string& alias : shards_[i].aliases) {
        if (wanted.count(alias)) namesOf[i].push_back(alias);
      }
    }
  } else {
    for (size_t i = 0; i < shards_.size(); ++i) {
      if (!shards_[i].persistent) continue;  // no state_dict key
      namesOf[i].push_back(shards_[i].spec.name);
      namesOf[i].insert(namesOf[i].end(), shards_[i].aliases.begin(), shards_[i].aliases.end());
    }
  }
  shard::ShardLayout subset;
  std::vector<at::Tensor> subsetPieces;
  std::vector<size_t> gathered;
  for (size_t i = 0; i < layout_.specs.size(); ++i) {
    if (namesOf[i].empty()) continue;
    subset.specs.push_back(layout_.specs[i]);
    if (!pieces.empty()) subsetPieces.push_back(pieces[i]);
    gathered.push_back(i);
  }
  std::vector<std::pair<std::string, at::Tensor>> full =
      shard::gatherFull(comm, subset, subsetPieces, options);
  if (full.empty()) return full;  // not a receiving rank
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t k = 0; k < gathered.size(); ++k) {
    const LocalShard& shard = shards_[gathered[k]];
    if (shard.splitDim > 0) {
      full[k].second = full[k].second.movedim(0, shard.splitDim).contiguous();
    }
    const std::vector<std::string>& names = namesOf[gathered[k]];
    for (size_t n = 0; n < names.size(); ++n) {
      // A copy per further name: one storage under two names is what
      // safetensors refuses to save.
      out.emplace_back(names[n], n == 0 ? full[k].second : full[k].second.clone());
    }
  }
  return out;
}

std::vector<LocalShard> shardsFromFullTensors(const std::vector<TrackedTensor>& full,
                                              shard::LayoutKind kind, int64_t rank,
                                              int64_t worldSize) {
  std::vector<LocalShard> shards;
  shards.reserve(full.size());
  for (const TrackedTensor& tensor : full) {
    TORCH_CHECK_VALUE(!tensor.source.defined() || tensor.source.layout() == at::kStrided,
                      "shardsFromFullTensors: tensor '", tensor.name, "' has layout ",
                      tensor.source.layout(),
                      "; only dense (strided) tensors can be tracked (densify it with to_dense())");
    TORCH_CHECK_VALUE(tensor.source.defined() && tensor.source.is_contiguous(),
                      "shardsFromFullTensors: tensor '", tensor.name,
                      "' must be a defined, contiguous tensor (its rows become views)");
    shard::ShardSpec spec = specFor(tensor, kind, worldSize);
    TORCH_CHECK_VALUE(rank >= 0 && rank < worldSize, "shardsFromFullTensors: rank ", rank,
                      " is outside the world size ", worldSize);
    shards.push_back(LocalShard{localRowsOf(tensor.source, kind, rank, worldSize), std::move(spec),
                                tensor.role, tensor.changesInForward, tensor.writeVersion});
  }
  return shards;
}

std::vector<LocalShard> shardsFromFlatParam(const shard::FlatParamLayout& layout,
                                            const at::Tensor& localFlatShard, int64_t rank,
                                            TrackRole role) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < layout.worldSize(), "shardsFromFlatParam: rank ", rank,
                    " is outside the world size ", layout.worldSize());
  TORCH_CHECK_VALUE(localFlatShard.defined() && localFlatShard.dim() == 1 &&
                        localFlatShard.numel() == layout.shardNumel(),
                    "shardsFromFlatParam: the local flat shard must be 1-D with ",
                    layout.shardNumel(), " elements (padding included), got shape ",
                    localFlatShard.defined() ? localFlatShard.sizes() : c10::IntArrayRef{});
  TORCH_CHECK_VALUE(localFlatShard.scalar_type() == layout.dtype(),
                    "shardsFromFlatParam: the local flat shard has dtype ",
                    localFlatShard.scalar_type(), " but the layout's is ", layout.dtype());
  std::vector<shard::ShardSpec> specs = layout.specs();
  std::vector<LocalShard> shards;
  shards.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t size = specs[i].rangeOf(rank).size();
    at::Tensor local = localFlatShard.narrow(0, layout.localOffset(i, rank), size);
    shards.push_back(LocalShard{std::move(local), std::move(specs[i]), role});
  }
  return shards;
}

}  // namespace shardema
