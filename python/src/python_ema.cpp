#include "python_ema.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <string>
#include <utility>

#include "shardema/core/file_metadata.h"
#include "shardema/shard/agreement.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"

namespace shardema::python {
namespace {

constexpr const char* kApi = "shardema.EMA";

std::string toString(int64_t value) { return std::to_string(value); }

// The value of `key` in a state's metadata; ValueError naming it if absent.
const std::string& metadataValue(const RankState& state, const char* key) {
  auto it = state.metadata.find(key);
  TORCH_CHECK_VALUE(it != state.metadata.end(), kApi, ".load_state_dict: the state has no '", key,
                    "' (not a state_dict() of shardema.EMA)");
  return it->second;
}

}  // namespace

// The first tensor a state_dict() of another model differs in: the state
// holds this rank's EMA pieces by name, so names and sizes can be compared.
std::string PythonEma::stateDifference(const RankState& state) const {
  std::map<std::string, int64_t> saved;
  for (const auto& [name, tensor] : state.tensors) saved[name] = tensor.numel();
  for (const LocalShard& s : averager_->shards()) {
    auto it = saved.find(s.spec.name);
    if (it == saved.end())
      return "tensor '" + s.spec.name + "' is tracked here but not in the state";
    if (it->second != s.local.numel()) {
      return "tensor '" + s.spec.name + "' has " + std::to_string(it->second) +
             " elements on this rank in the state but " + std::to_string(s.local.numel()) + " here";
    }
    saved.erase(it);
  }
  if (!saved.empty())
    return "tensor '" + saved.begin()->first + "' is in the state but not tracked here";
  return "the same tensors and sizes, but another shape, dtype or split of them";
}

PythonEma::PythonEma(std::unique_ptr<shard::Communicator> comm, std::vector<LocalShard> shards,
                     std::vector<TrackedTensor> wholeTensors, AveragerOptions options,
                     std::string layoutName, std::vector<SourceOwner> owners)
    : comm_(std::move(comm)),
      wholeTensors_(std::move(wholeTensors)),
      layoutName_(std::move(layoutName)) {
  TORCH_CHECK_VALUE(owners.empty() || owners.size() == shards.size(), kApi, ": ", owners.size(),
                    " owners for ", shards.size(), " shards");
  for (size_t i = 0; i < owners.size(); ++i) {
    const SourceOwner& owner = owners[i];
    owners_.push_back(Owner::of(owner.tensor, owner.kind));
    owners_.back().decidesTrainable = owner.trainable.defined();
    // Writes go through the parameter: a DTensor's local tensor keeps its
    // own counter while the optimizer bumps the DTensor's (a plain
    // parameter's rows share its counter, so this changes nothing there).
    if (owner.trainable.defined()) {
      shards[i].writeVersion = owner.trainable.unsafeGetTensorImpl()->version_counter();
    }
  }
  averager_ = std::make_unique<ShardedAverager>(comm_->rank(), comm_->worldSize(),
                                                std::move(shards), std::move(options));
}

PythonEma::~PythonEma() = default;

bool PythonEma::update(std::optional<int64_t> step) {
  // Inside swap() the model holds the EMA: an update would fold the EMA
  // into itself and advance the step.
  TORCH_CHECK(!swapped(), kApi, ".update: the EMA is swapped into the model; update() after ",
              "leaving swap() (the model holds the EMA weights inside it)");
  followReplacedData();
  return averager_->update(step ? *step : averager_->step() + 1);
}

// The Averager averages a kAverageIfTrainable source while it requires
// grad and copies it otherwise; here each such source takes the flag of the
// parameter it belongs to at this update (freezing and unfreezing during
// training, VersatIL's rule). Where the flags differ, the source becomes a
// detached alias of the same elements carrying the parameter's flag: no
// copy, and nothing of the model's autograd state changes.
void PythonEma::mirrorTrainable(const std::vector<bool>& trainable) {
  const std::vector<LocalShard>& shards = averager_->shards();
  size_t next = 0;
  for (size_t i = 0; i < owners_.size(); ++i) {
    if (!owners_[i].decidesTrainable) continue;
    TORCH_CHECK_VALUE(next < trainable.size(), kApi, ".mirror_trainable: ", trainable.size(),
                      " flags for more parameters");
    const bool flag = trainable[next++];
    if (shards[i].role != TrackRole::kAverageIfTrainable) continue;
    if (shards[i].local.requires_grad() == flag) continue;
    at::Tensor alias = shards[i].local.detach();
    alias.set_requires_grad(flag);
    averager_->rebindLocal(shards[i].spec.name, alias);
  }
  TORCH_CHECK_VALUE(next == trainable.size(), kApi, ".mirror_trainable: ", trainable.size(),
                    " flags for ", next, " parameters");
}

// A parameter whose data was replaced in place (`p.data = t`,
// `module.to(...)`) is the same TensorImpl with another storage, but the
// shard we track is a view made from the old one: it would keep reading the
// old values. Compared here at each update (a few comparisons per tensor).
void PythonEma::followReplacedData() {
  for (size_t i = 0; i < owners_.size(); ++i) {
    Owner& owner = owners_[i];
    if (!owner.tensor.defined()) continue;
    const at::Tensor& t = owner.tensor;
    if (t.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl() == owner.storage &&
        t.storage_offset() == owner.offset && t.scalar_type() == owner.dtype &&
        t.sizes() == owner.sizes) {
      continue;
    }
    rebind(i, t);
  }
}

void PythonEma::rebind(size_t index, const at::Tensor& replacement) {
  TORCH_CHECK_INDEX(index < owners_.size(), kApi, ": no tracked tensor ", index);
  Owner& owner = owners_[index];
  const LocalShard& shard = averager_->shards()[index];
  const std::string& name = shard.spec.name;
  TORCH_CHECK_VALUE(owner.kind.has_value(), kApi, ": tensor '", name,
                    "' was replaced, and an EMA of local shards cannot follow it");
  TORCH_CHECK_VALUE(replacement.layout() == at::kStrided, kApi, ": tensor '", name,
                    "' was replaced by a ", replacement.layout(), " tensor; the EMA follows dense ",
                    "tensors only");
  const bool sameKind = replacement.scalar_type() == owner.dtype &&
                        replacement.sizes() == c10::IntArrayRef(owner.sizes) &&
                        replacement.device() == shard.local.device();
  TORCH_CHECK_VALUE(sameKind, kApi, ": tensor '", name, "' changed after the EMA was built, from ",
                    owner.dtype, " ", c10::IntArrayRef(owner.sizes), " on ", shard.local.device(),
                    " to ", replacement.scalar_type(), " ", replacement.sizes(), " on ",
                    replacement.device(),
                    " (module.to(), p.data = ..., a new nn.Parameter): "
                    "the EMA cannot follow it. Convert or move the model before building the EMA");
  TORCH_CHECK_VALUE(replacement.is_contiguous(), kApi, ": tensor '", name,
                    "' was replaced by a non-contiguous tensor; the EMA follows contiguous ones");
  TrackedTensor full{name, replacement, shard.role, shard.changesInForward};
  std::vector<LocalShard> local = shardsFromFullTensors({full}, *owner.kind, rank(), worldSize());
  averager_->rebindLocal(name, local.front().local);
  for (TrackedTensor& whole : wholeTensors_) {
    if (whole.name == name) whole.source = replacement;
  }
  const bool decidesTrainable = owner.decidesTrainable;
  owner = Owner::of(replacement, owner.kind);
  owner.decidesTrainable = decidesTrainable;
  followed_.push_back(name);
}

PythonEma::Owner PythonEma::Owner::of(const at::Tensor& tensor,
                                      std::optional<shard::LayoutKind> kind) {
  Owner owner;
  owner.kind = kind;
  if (!tensor.defined()) return owner;
  owner.tensor = tensor;
  owner.storage = tensor.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  owner.offset = tensor.storage_offset();
  owner.dtype = tensor.scalar_type();
  owner.sizes = tensor.sizes().vec();
  return owner;
}

std::vector<std::string> PythonEma::takeFollowed() {
  std::vector<std::string> out;
  out.swap(followed_);
  return out;
}

void PythonEma::writeEmaIntoModel() {
  averager_->averager().copyTo();
  if (wholeTensors_.empty()) return;
  // The tensors every rank holds whole (replicated, DDP): each rank averaged
  // its rows, every rank needs all. Only those are gathered: the sharded
  // ones (FSDP2, tensor parallelism) were written above from this rank's
  // own EMA, and assembling them would cost their full size on every rank.
  shard::GatherOptions options;
  options.root = -1;
  std::vector<std::string> names;
  names.reserve(wholeTensors_.size());
  for (const TrackedTensor& whole : wholeTensors_) names.push_back(whole.name);
  std::map<std::string, at::Tensor> full;
  for (auto& [name, tensor] : averager_->fullStateDict(*comm_, options, names)) {
    full[name] = tensor;
  }
  at::NoGradGuard noGrad;
  for (const TrackedTensor& whole : wholeTensors_) {
    auto it = full.find(whole.name);
    TORCH_CHECK(it != full.end(), kApi, ": no gathered EMA for '", whole.name, "'");
    whole.source.copy_(it->second.view(whole.source.sizes()));
  }
}

void PythonEma::copyTo() {
  TORCH_CHECK(!swapped(), kApi, ".copy_to: the EMA is swapped in; leave swap() first");
  writeEmaIntoModel();
}

void PythonEma::swapIn() {
  TORCH_CHECK(!swapped(), kApi, ".swap: already swapped in (swap() does not nest)");
  averager_->wait();
  std::vector<at::Tensor> raw;
  for (const LocalShard& s : averager_->shards()) raw.push_back(s.local.detach().clone());
  for (const TrackedTensor& t : wholeTensors_) raw.push_back(t.source.detach().clone());
  // Kept before anything is written: a replicated swap writes this rank's
  // rows and then gathers the others', and a gather that fails (a rank
  // gone, a timeout) must not leave the model half EMA, half raw.
  raw_ = std::move(raw);
  try {
    writeEmaIntoModel();
  } catch (...) {
    swapOut();
    throw;
  }
}

void PythonEma::swapOut() {
  if (!swapped()) return;
  at::NoGradGuard noGrad;
  const auto& shards = averager_->shards();
  for (size_t i = 0; i < shards.size(); ++i) shards[i].local.copy_(raw_[i]);
  for (size_t i = 0; i < wholeTensors_.size(); ++i) {
    wholeTensors_[i].source.copy_(raw_[shards.size() + i]);
  }
  raw_.clear();
}

namespace {

// The two loads below: every tracked shard named in `values` takes the
// piece `pieceOf` cuts from its value (shard, value -> local-shaped piece);
// the other shards keep their EMA, untracked names are ignored.
template <typename PieceOf>
LoadReport loadPieces(ShardedAverager& averager,
                      const std::vector<std::pair<std::string, at::Tensor>>& values,
                      const PieceOf& pieceOf) {
  std::map<std::string, const at::Tensor*> byName;
  for (const auto& entry : values) byName[entry.first] = &entry.second;
  std::vector<std::pair<std::string, at::Tensor>> pieces;
  for (const LocalShard& s : averager.shards()) {
    auto it = byName.find(s.spec.name);
    if (it != byName.end()) pieces.emplace_back(s.spec.name, pieceOf(s, *it->second));
  }
  return averager.averager().loadEmaValues(pieces, LoadStrictness::kNonStrict);
}

}  // namespace

LoadReport PythonEma::loadFullValues(const std::vector<std::pair<std::string, at::Tensor>>& full) {
  return loadPieces(*averager_, full, [this](const LocalShard& s, const at::Tensor& tensor) {
    TORCH_CHECK_VALUE(tensor.numel() == s.spec.numel(), kApi, ": '", s.spec.name, "' has ",
                      tensor.numel(), " elements, the tracked tensor ", s.spec.numel());
    const shard::ElementRange range = s.spec.heldRange(rank());
    at::Tensor piece = tensor.detach().reshape({-1}).slice(0, range.begin, range.end);
    return piece.reshape(s.local.sizes());
  });
}

LoadReport PythonEma::loadLocalValues(
    const std::vector<std::pair<std::string, at::Tensor>>& local) {
  return loadPieces(*averager_, local, [](const LocalShard& s, const at::Tensor& tensor) {
    TORCH_CHECK_VALUE(tensor.numel() == s.local.numel(), kApi, ": the local piece of '",
                      s.spec.name, "' has ", tensor.numel(), " elements, this rank's shard ",
                      s.local.numel());
    return tensor.detach().reshape(s.local.sizes());
  });
}

RankState PythonEma::stateDict() const {
  TensorFile file = averager_->averager().state();
  RankState state;
  for (auto& [name, tensor] : file.tensors) state.tensors.emplace_back(name, tensor.clone());
  state.metadata = std::move(file.metadata);
  state.metadata[detail::kRankKey] = toString(rank());
  state.metadata[detail::kWorldSizeKey] = toString(worldSize());
  state.metadata[detail::kLayoutFingerprintKey] = averager_->layout().fingerprint();
  return state;
}

void PythonEma::loadStateDict(const RankState& state) {
  const std::string& rank = metadataValue(state, detail::kRankKey);
  const std::string& world = metadataValue(state, detail::kWorldSizeKey);
  const std::string& fingerprint = metadataValue(state, detail::kLayoutFingerprintKey);
  TORCH_CHECK_VALUE(rank == toString(this->rank()) && world == toString(worldSize()), kApi,
                    ".load_state_dict: the state is rank ", rank, " of ", world,
                    " but this is rank ", this->rank(), " of ", worldSize(),
                    "; to change world size, save_checkpoint(), reshard it with `shardema export "
                    "--world-size`, and load_checkpoint()");
  TORCH_CHECK_VALUE(fingerprint == averager_->layout().fingerprint(), kApi,
                    ".load_state_dict: the state is not of this model: ", stateDifference(state),
                    " (the state's layout fingerprint ", fingerprint, ", this EMA's ",
                    averager_->layout().describe(), ")");
  TensorFile file;
  file.tensors = state.tensors;
  file.metadata = state.metadata;
  averager_->averager().loadState(file, LoadStrictness::kStrict);
}

at::Tensor PythonEma::ema(const std::string& name, int profile) const {
  return averager_->averager().ema(name, profile).clone();
}

std::vector<std::pair<std::string, at::Tensor>> PythonEma::localEma() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const std::vector<at::Tensor> pieces = averager_->localEma();
  const auto& specs = averager_->layout().specs;
  for (size_t i = 0; i < pieces.size(); ++i) out.emplace_back(specs[i].name, pieces[i].clone());
  return out;
}

void PythonEma::saveCheckpoint(const std::string& folder) {
  ::shardema::saveCheckpoint(*comm_, folder, *averager_);
}

void PythonEma::loadCheckpoint(const std::string& folder) {
  // Keep what we have, so that a rank that loaded can go back when another
  // rank failed: a collective load changes all ranks or none. A failed EMA
  // has nothing worth keeping; it goes back to failed.
  const bool wasFailed = averager_->averager().failed();
  TensorFile before;
  if (!wasFailed) {
    before = averager_->averager().state();
    for (auto& entry : before.tensors) entry.second = entry.second.clone();
  }
  std::string error;
  try {
    ::shardema::loadCheckpoint(folder, *averager_);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  shard::AgreementRequest request;
  request.api = "shardema.EMA.load_checkpoint";
  request.consequence = "no rank changed its EMA";
  request.localError = error;
  request.failureIsValueError = true;
  try {
    shard::agreeAcrossRanks(*comm_, request);
  } catch (...) {
    if (error.empty() && wasFailed) {
      averager_->averager().markFailed("a load_checkpoint failed on another rank");
    } else if (error.empty()) {
      averager_->averager().loadState(before, LoadStrictness::kStrict);
    }
    throw;
  }
}

void PythonEma::exportWeights(const std::string& path, c10::ScalarType dtype) {
  averager_->exportWeights(*comm_, path, dtype);
}

std::vector<std::pair<std::string, at::Tensor>> PythonEma::fullStateDict(
    bool rank0Only, const std::optional<std::vector<std::string>>& names) {
  shard::GatherOptions options;
  options.root = rank0Only ? 0 : -1;
  return averager_->fullStateDict(*comm_, options, names);
}

}  // namespace shardema::python
