#include "python_ema.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <set>
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
  for (const auto& [stored, tensor] : state.tensors) {
    std::string name;
    // Profiles beyond the first hold the same tensors again.
    if (profileOfStoredName(stored, &name) == 0) saved[stored] = tensor.numel();
  }
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
                     std::vector<TrackedTensor> wholeTensors, PythonEmaOptions options,
                     std::string layoutName, ModelWatch watch,
                     const std::vector<Decider>& deciders)
    : comm_(std::move(comm)),
      wholeTensors_(std::move(wholeTensors)),
      layoutName_(std::move(layoutName)),
      watch_(std::move(watch)) {
  for (const Decider& decider : deciders) {
    TORCH_CHECK_VALUE(decider.shard < shards.size(), kApi, ": decider of shard ", decider.shard,
                      " of ", shards.size());
    // Writes go through the parameter: a DTensor's local tensor keeps its
    // own counter while the optimizer bumps the DTensor's (a plain
    // parameter's rows share its counter, so this changes nothing there).
    shards[decider.shard].writeVersion =
        decider.parameter.unsafeGetTensorImpl()->version_counter();
    deciderShards_.push_back(decider.shard);
  }
  // The Python front's rule for writes (averager.h, SourceWrites).
  options.averager.sourceWrites = SourceWrites::kAdaptive;
  averager_ = std::make_unique<ShardedAverager>(comm_->rank(), comm_->worldSize(),
                                                std::move(shards), std::move(options.averager));
}

PythonEma::~PythonEma() = default;

bool PythonEma::update(std::optional<int64_t> step) {
  // Inside a swap (this EMA's or another's) the Averager refuses, naming
  // the tensor and who swapped: weight_swap.h.
  return averager_->update(step ? *step : averager_->step() + 1);
}

void PythonEma::writeEmaIntoModel(int profile) {
  averager_->averager().copyTo(profile);
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
  for (auto& [name, tensor] : averager_->fullStateDict(*comm_, options, names, profile)) {
    full[name] = tensor;
  }
  at::NoGradGuard noGrad;
  for (const TrackedTensor& whole : wholeTensors_) {
    auto it = full.find(whole.name);
    TORCH_CHECK(it != full.end(), kApi, ": no gathered EMA for '", whole.name, "'");
    whole.source.copy_(it->second.view(whole.source.sizes()));
  }
}

// What a write of the EMA into the model overwrites: the tensors held
// whole (gathered into), and this rank's shards of the others (a shard of a
// whole tensor is a view of it, already covered).
std::vector<std::pair<std::string, at::Tensor>> PythonEma::modelTargets() const {
  std::vector<std::pair<std::string, at::Tensor>> targets;
  std::set<std::string> whole;
  for (const TrackedTensor& t : wholeTensors_) {
    targets.emplace_back(t.name, t.source);
    whole.insert(t.name);
  }
  for (const LocalShard& s : averager_->shards()) {
    if (whole.count(s.spec.name) == 0) targets.emplace_back(s.spec.name, s.local);
  }
  return targets;
}

void PythonEma::copyTo(int profile) {
  TORCH_CHECK(!swapped(), kApi, ".copy_to: the EMA is swapped in; leave swap() first");
  checkModelWritable(modelTargets(), "shardema.EMA.copy_to");
  writeEmaIntoModel(profile);
}

void PythonEma::swapIn(int profile) {
  TORCH_CHECK(!swapped(), kApi, ".swap: already swapped in (swap() does not nest)");
  averager_->wait();
  // The raw values are kept before anything is written: a replicated swap
  // writes this rank's rows and then gathers the others', and a gather
  // that fails (a rank gone, a timeout) must not leave the model half EMA,
  // half raw.
  swap_ = std::make_unique<WeightSwap>(modelTargets(), kApi);
  try {
    writeEmaIntoModel(profile);
  } catch (...) {
    swap_.reset();
    throw;
  }
}

void PythonEma::swapOut() {
  if (!swapped()) return;
  swap_->restore();
  swap_.reset();
}

namespace {

// The two loads below: every tracked shard named in `values` takes the
// piece `pieceOf` cuts from its value (shard, value -> local-shaped piece);
// the other shards keep their EMA, untracked names are ignored.
template <typename PieceOf>
LoadReport loadPieces(ShardedAverager& averager,
                      const std::vector<std::pair<std::string, at::Tensor>>& values,
                      const PieceOf& pieceOf, int profile) {
  std::map<std::string, const at::Tensor*> byName;
  for (const auto& entry : values) byName[entry.first] = &entry.second;
  std::vector<std::pair<std::string, at::Tensor>> pieces;
  for (const LocalShard& s : averager.shards()) {
    auto it = byName.find(s.spec.name);
    if (it != byName.end()) pieces.emplace_back(s.spec.name, pieceOf(s, *it->second));
  }
  return averager.averager().loadEmaValues(pieces, LoadStrictness::kNonStrict, profile);
}

}  // namespace

LoadReport PythonEma::loadFullValues(const std::vector<std::pair<std::string, at::Tensor>>& full,
                                     int profile) {
  return loadPieces(
      *averager_, full,
      [this](const LocalShard& s, const at::Tensor& tensor) {
        TORCH_CHECK_VALUE(tensor.numel() == s.spec.numel(), kApi, ": '", s.spec.name, "' has ",
                          tensor.numel(), " elements, the tracked tensor ", s.spec.numel());
        const shard::ElementRange range = s.spec.heldRange(rank());
        at::Tensor piece = tensor.detach().reshape({-1}).slice(0, range.begin, range.end);
        return piece.reshape(s.local.sizes());
      },
      profile);
}

LoadReport PythonEma::loadLocalValues(const std::vector<std::pair<std::string, at::Tensor>>& local,
                                      int profile) {
  return loadPieces(
      *averager_, local,
      [](const LocalShard& s, const at::Tensor& tensor) {
        TORCH_CHECK_VALUE(tensor.numel() == s.local.numel(), kApi, ": the local piece of '",
                          s.spec.name, "' has ", tensor.numel(), " elements, this rank's shard ",
                          s.local.numel());
        return tensor.detach().reshape(s.local.sizes());
      },
      profile);
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

RankState PythonEma::stateTemplate() const {
  RankState state;
  const Averager& averager = averager_->averager();
  for (const std::string& name : averager.names()) {
    const auto [dtype, shape] = averager.emaDtypeAndShape(name);
    // One element seen at every index (an expanded scalar): the shape, no memory.
    state.tensors.emplace_back(name, at::empty({}, at::TensorOptions().dtype(dtype)).expand(shape));
  }
  // Averager::state()'s further profiles: the averaged tensors again.
  for (int p = 1; p < averager.numProfiles(); ++p) {
    for (const std::string& name : averager.names()) {
      if (!isAveragingRole(averager.role(name))) continue;
      const auto [dtype, shape] = averager.emaDtypeAndShape(name);
      state.tensors.emplace_back(profileTensorName(name, p),
                                 at::empty({}, at::TensorOptions().dtype(dtype)).expand(shape));
    }
  }
  state.metadata = averager.stateMetadata();
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

std::vector<std::pair<std::string, at::Tensor>> PythonEma::localEma(int profile) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const std::vector<at::Tensor> pieces = averager_->localEma(profile);
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

void PythonEma::exportWeights(const std::string& path, c10::ScalarType dtype,
                              std::optional<int64_t> maxShardBytes, int profile,
                              const std::vector<UntrackedTensor>& untracked) {
  averager_->exportWeights(*comm_, path, dtype, shard::GatherOptions{}, maxShardBytes, profile,
                           untracked);
}

std::vector<std::pair<std::string, at::Tensor>> PythonEma::fullStateDict(
    bool rank0Only, const std::optional<std::vector<std::string>>& names, int profile) {
  shard::GatherOptions options;
  options.root = rank0Only ? 0 : -1;
  return averager_->fullStateDict(*comm_, options, names, profile);
}

}  // namespace shardema::python
