// PostHocCallback: the validation swap of the synthesized defaultOutputSigma
// and the end of training (final snapshot, synthesis, deployable weights).
// A little over the ~400-line guideline: the swap's paths (rank 0, shards,
// HSDP's replicas) and the end share this file's solve agreement and piece
// helpers, which a split would move into a header of their own.
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <unordered_map>

#include "sharded_internal.h"
#include "shardema/core/file_system.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/warning.h"
#include "shardema/posthoc_callback.h"
#include "shardema/shard/agreement.h"
#include "shardema/shard/communicator.h"
#include "shardema/shard/gather.h"
#include "shardema/synthesis.h"
#include "weighted_snapshots.h"

namespace shardema {
namespace {

constexpr const char* kFinishApi = "PostHocCallback";

SnapshotSynthesisOptions synthesisOptions(const PostHocCallbackOptions& o, int64_t step,
                                          c10::ScalarType dtype) {
  SnapshotSynthesisOptions out;
  out.sigmaRel = o.defaultOutputSigma;
  out.step = step;
  out.normalize = o.normalize;
  out.outputDtype = dtype;
  out.bufferBytes = o.bufferBytes;
  return out;
}

std::unordered_map<std::string, at::Tensor> byName(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::unordered_map<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : tensors) out.emplace(name, tensor);
  return out;
}

// Fixed-size fingerprint of a solve, so ranks can check they synthesized
// from the same snapshot set: [used snapshots, target step, sum bits].
std::vector<uint64_t> solveFingerprint(const SynthesisWeights* weights) {
  if (weights == nullptr) return {0, 0, 0};
  uint64_t used = 0;
  for (bool u : weights->used) used += u ? 1 : 0;
  uint64_t sumBits = 0;
  std::memcpy(&sumBits, &weights->sum, sizeof sumBits);
  return {used, static_cast<uint64_t>(weights->targetStep), sumBits};
}

// Every rank's solve must be the same system: a rank that lost a snapshot
// (or failed, `ownError`) would otherwise mix other weights into its
// shards. One agreement over the fingerprints: every rank throws together
// when one failed or solved another system than rank 0.
void agreeOnSolves(shard::Communicator& comm, const SynthesisWeights* mine,
                   const std::string& ownError, shard::AgreementRequest request) {
  request.words = solveFingerprint(mine);
  request.localError = ownError;
  const shard::Agreement solves = shard::agreeAcrossRanks(comm, request);
  int64_t differs = -1;
  for (size_t i = 0; i < request.words.size(); ++i) {
    const int64_t r = solves.firstRankDifferingFromRankZero(i);
    if (r >= 0 && (differs < 0 || r < differs)) differs = r;
  }
  TORCH_CHECK(differs < 0, request.api, ": ", request.consequence, ": rank ", differs,
              " synthesized from another snapshot set than rank 0");
}

int64_t splitDimOf(const std::map<std::string, int64_t>& splitDims, const std::string& name) {
  const auto found = splitDims.find(name);
  return found == splitDims.end() ? 0 : found->second;
}

// `pieces` (this rank's, layout order) as full tensors when they are all
// there is (one rank): a tensor-parallel piece is then the whole tensor in
// its own layout.
std::vector<std::pair<std::string, at::Tensor>> wholeFromPieces(
    const shard::ShardLayout& layout, const std::vector<at::Tensor>& pieces,
    const std::map<std::string, int64_t>& splitDims = {}) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const shard::ShardSpec& spec = layout.specs[i];
    out.emplace_back(spec.name, pieces[i].reshape(detail::splitTensorShape(
                                    spec, splitDimOf(splitDims, spec.name))));
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> PostHocCallback::piecesInLayoutOrder(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors) const {
  const std::unordered_map<std::string, at::Tensor> values = byName(tensors);
  std::vector<at::Tensor> pieces;
  for (const shard::ShardSpec& spec : averager_->layout().specs) {
    const auto found = values.find(spec.name);
    TORCH_CHECK_VALUE(found != values.end(), kFinishApi, ": the snapshots in ", snapshotFolder(),
                      " hold no '", spec.name, "'");
    pieces.push_back(found->second.reshape({-1}));
  }
  return pieces;
}

bool PostHocCallback::onValidationStart() {
  TORCH_CHECK(averager_ != nullptr, kFinishApi, "::onValidationStart: called before onFitStart");
  TORCH_CHECK(!emaSwappedIn(), kFinishApi, "::onValidationStart: the EMA is already swapped in");
  if (options_.layout == PostHocLayout::kSharded) return swapInSharded();
  return swapInRankZero();
}

void PostHocCallback::onValidationEnd() {
  if (!emaSwappedIn()) return;
  swap_->restore();
  swap_.reset();
}

// The swap (weight_swap.h) of the floating targets: their raw values in
// host memory, every Averager fenced first, a module another swap holds
// refused naming the holder.
void PostHocCallback::keepRawForValidation() {
  NamedTensors targets;
  for (const TrackedTensor& target : swapTargets_) {
    if (at::isFloatingType(target.source.scalar_type())) {
      targets.emplace_back(target.name, target.source);
    }
  }
  swap_ = std::make_unique<WeightSwap>(std::move(targets), kFinishApi);
}

void PostHocCallback::checkSwapValues(
    const std::unordered_map<std::string, at::Tensor>& values) const {
  for (const TrackedTensor& target : swapTargets_) {
    if (!at::isFloatingType(target.source.scalar_type())) continue;
    const auto found = values.find(target.name);
    TORCH_CHECK_VALUE(found != values.end() && found->second.numel() == target.source.numel(),
                      kFinishApi, "::onValidationStart: the synthesized EMA holds no '",
                      target.name, "' of ", target.source.numel(), " elements");
  }
}

void PostHocCallback::swapInValues(const std::unordered_map<std::string, at::Tensor>& values) {
  checkSwapValues(values);
  // Raw copies first: whatever fails below, onValidationEnd restores them.
  keepRawForValidation();
  torch::NoGradGuard noGrad;
  for (const TrackedTensor& target : swapTargets_) {
    if (!at::isFloatingType(target.source.scalar_type())) continue;
    target.source.copy_(values.at(target.name).view(target.source.sizes()));
  }
}

bool PostHocCallback::swapInSharded() {
  // Every rank counts the same calls, so all agree on whether there is a
  // snapshot without asking each other.
  if (newestSnapshot_ == 0) {
    wait();
    return false;
  }
  std::unordered_map<std::string, at::Tensor> values;
  std::string ownError;
  if (holdsEma()) {
    try {
      values = synthesizedSwapValues();
      checkSwapValues(values);
    } catch (...) {
      if (ranks_.replicas == nullptr) throw;
      ownError = detail::currentErrorMessage();
      values.clear();
    }
  }
  if (ranks_.replicas != nullptr) shareWithReplicas(values, ownError);
  swapInValues(values);
  return true;
}

// What each swap target of this rank takes: its synthesized piece (from
// this rank's snapshots), the gathered whole of a tensor every rank holds.
std::unordered_map<std::string, at::Tensor> PostHocCallback::synthesizedSwapValues() {
  const bool collective = ranks_.worldSize > 1;  // the constructor made sure of comm
  std::optional<SynthesizedTensors> synth;
  std::vector<at::Tensor> pieces;
  std::string ownError;
  try {
    // The swap writes the tracked tensors: no update may still read them.
    wait();
    synth = synthesizeSnapshots(scanRankSnapshots(options_.checkpointFolder, ranks_.rank),
                                synthesisOptions(options_, newestSnapshot_, at::kFloat));
    pieces = piecesInLayoutOrder(synth->tensors);
  } catch (...) {
    if (!collective) throw;
    ownError = detail::currentErrorMessage();
    synth.reset();
  }
  if (collective) {
    shard::AgreementRequest request;
    request.api = std::string(kFinishApi) + "::onValidationStart";
    request.consequence = "the EMA was not swapped in";
    agreeOnSolves(*ranks_.comm, synth ? &synth->weights : nullptr, ownError, request);
  }
  if (!swapWholeTensors_) {
    // Real shards (FSDP locals): each rank swaps what it holds, and the
    // tensors every rank holds whole (buffers beside FSDP2 parameters)
    // take their gathered EMA, so the ranks agree on them.
    std::unordered_map<std::string, at::Tensor> values = byName(synth->tensors);
    if (!gatheredForSwap_.empty()) {
      shard::ShardLayout replicated;
      std::vector<at::Tensor> replicatedPieces;
      const shard::ShardLayout& layout = averager_->layout();
      for (const std::string& name : gatheredForSwap_) {
        for (size_t i = 0; i < layout.specs.size(); ++i) {
          if (layout.specs[i].name != name) continue;
          replicated.specs.push_back(layout.specs[i]);
          replicatedPieces.push_back(pieces[i]);
        }
      }
      std::vector<std::pair<std::string, at::Tensor>> whole;
      if (collective) {
        shard::GatherOptions gather;
        gather.root = -1;
        gather.bufferBytes = options_.bufferBytes;
        whole = shard::gatherFull(*ranks_.comm, replicated, replicatedPieces, gather);
      } else {
        whole = wholeFromPieces(replicated, replicatedPieces);
      }
      for (auto& [name, tensor] : whole) values[name] = tensor;
    }
    return values;
  }
  // A replicated module: every rank needs the whole EMA, not just its rows.
  std::vector<std::pair<std::string, at::Tensor>> whole;
  if (collective) {
    shard::GatherOptions gather;
    gather.root = -1;
    gather.bufferBytes = options_.bufferBytes;
    whole = shard::gatherFull(*ranks_.comm, averager_->layout(), pieces, gather);
  } else {
    whole = wholeFromPieces(averager_->layout(), pieces);
  }
  return byName(whole);
}

// HSDP: the first replica's values to the same rank of the others, once
// every replica knows it has them (or every replica fails with its error,
// the raw weights in place).
void PostHocCallback::shareWithReplicas(std::unordered_map<std::string, at::Tensor>& values,
                                        const std::string& ownError) {
  shard::Communicator& replicas = *ranks_.replicas;
  shard::AgreementRequest request;
  request.api = std::string(kFinishApi) + "::onValidationStart";
  request.consequence = "the EMA was not swapped in on any HSDP replica";
  request.localError = ownError;
  shard::agreeAcrossRanks(replicas, request);
  for (const TrackedTensor& target : swapTargets_) {
    if (!at::isFloatingType(target.source.scalar_type())) continue;
    at::Tensor value = replicas.rank() == 0 ? values.at(target.name).to(at::kFloat).contiguous()
                                            : at::empty({target.source.numel()},
                                                        at::TensorOptions().dtype(at::kFloat));
    replicas.broadcast(value, 0, "PostHocCallback validation replicas " + target.name);
    values[target.name] = value;
  }
}

bool PostHocCallback::swapInRankZero() {
  const bool collective = ranks_.worldSize > 1;
  TORCH_CHECK_VALUE(!collective || ranks_.comm != nullptr, kFinishApi,
                    "::onValidationStart: with worldSize ", ranks_.worldSize,
                    " the rank-0 layout broadcasts the synthesized weights and needs "
                    "ranks.comm");
  // Rank 0 decides (it alone holds the EMA and its snapshot count) and
  // says so before any tensor moves: 1 swap, 0 no snapshot yet, or every
  // rank fails with rank 0's error.
  std::unordered_map<std::string, at::Tensor> values;
  std::exception_ptr failure;
  uint64_t decision = 0;
  if (ranks_.rank == 0) {
    try {
      wait();
      if (newestSnapshot_ > 0) {
        const SnapshotFolder folder = scanSnapshotFolder(options_.checkpointFolder);
        values = byName(synthesizeSnapshots(folder.snapshots,
                                            synthesisOptions(options_, newestSnapshot_, at::kFloat))
                            .tensors);
        for (const TrackedTensor& target : swapTargets_) {
          if (!at::isFloatingType(target.source.scalar_type())) continue;
          const auto found = values.find(target.name);
          TORCH_CHECK_VALUE(found != values.end() && found->second.numel() == target.source.numel(),
                            kFinishApi, "::onValidationStart: the snapshots in ",
                            options_.checkpointFolder, " hold no '", target.name, "' of ",
                            target.source.numel(), " elements");
        }
        decision = 1;
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (collective) {
    shard::AgreementRequest request;
    request.api = std::string(kFinishApi) + "::onValidationStart";
    request.consequence = "the EMA was not swapped in";
    request.words = {decision};
    request.localError = failure ? detail::errorMessage(failure) : std::string();
    try {
      decision = shard::agreeAcrossRanks(*ranks_.comm, request).words[0][0];
    } catch (...) {
      if (failure) std::rethrow_exception(failure);  // rank 0 keeps its own error
      throw;
    }
  } else if (failure) {
    std::rethrow_exception(failure);
  }
  if (decision == 0) return false;
  keepRawForValidation();
  try {
    torch::NoGradGuard noGrad;
    for (const TrackedTensor& target : swapTargets_) {
      if (!at::isFloatingType(target.source.scalar_type())) continue;
      at::Tensor value = ranks_.rank == 0 ? values.at(target.name).contiguous()
                                          : at::empty(target.source.sizes(),
                                                      at::TensorOptions().dtype(at::kFloat));
      if (collective) {
        ranks_.comm->broadcast(value, 0, "PostHocCallback validation " + target.name);
      }
      target.source.copy_(value.view(target.source.sizes()));
    }
  } catch (...) {
    onValidationEnd();  // a broadcast failed midway: the raw weights come back
    throw;
  }
  return true;
}

std::string PostHocCallback::onTrainEnd() {
  TORCH_CHECK(averager_ != nullptr, kFinishApi, "::onTrainEnd: called before onFitStart");
  TORCH_CHECK(!emaSwappedIn(), kFinishApi, "::onTrainEnd: call onValidationEnd() first");
  if (calls_ == 0) {
    detail::warn(std::string(kFinishApi) + "::onTrainEnd: no call was counted (startIter " +
                 std::to_string(options_.startIter) + "); nothing to synthesize");
    return "";
  }
  if (options_.layout == PostHocLayout::kSharded) return finishSharded();
  return finishRankZero();
}

std::string PostHocCallback::deployablePath() const {
  return detail::joinPath(
      outputFolderOf(options_),
      deployableFileName(options_.outputPrefix, options_.defaultOutputSigma, calls_));
}

std::string PostHocCallback::finishRankZero() {
  if (ranks_.rank != 0) return "";
  wait();
  if (calls_ != newestSnapshot_) writeSnapshots();
  const std::string path = deployablePath();
  detail::ensureDirectory(detail::parentPath(path), kFinishApi);
  synthesizeSnapshotFolder(options_.checkpointFolder, path,
                           synthesisOptions(options_, calls_, options_.outputDtype));
  return path;
}

std::string PostHocCallback::finishSharded() {
  if (!holdsEma()) {
    // HSDP's later replicas: the first one writes for them.
    newestSnapshot_ = calls_;
    return "";
  }
  const std::string path = deployablePath();
  std::optional<SynthesizedTensors> synth;
  std::vector<at::Tensor> pieces;
  std::string localError;
  // Whatever fails on this rank (its last math, its final snapshot, its
  // synthesis) must reach the others through the checks below, not leave
  // them waiting in a collective.
  try {
    wait();
    if (calls_ != newestSnapshot_) writeSnapshots();
    synth = synthesizeSnapshots(scanRankSnapshots(options_.checkpointFolder, ranks_.rank),
                                synthesisOptions(options_, calls_, at::kFloat));
    pieces = piecesInLayoutOrder(synth->tensors);
    if (ranks_.rank == 0) {
      detail::ensureDirectory(detail::parentPath(path), kFinishApi);
    }
  } catch (...) {
    if (ranks_.worldSize == 1) throw;
    localError = detail::currentErrorMessage();
    synth.reset();
    pieces.clear();
  }
  const shard::ShardLayout& layout = averager_->layout();
  const std::map<std::string, int64_t> split = splitDims();
  const std::map<std::string, std::string> metadata =
      synth ? detail::synthesizedMetadata(synth->weights, options_.normalize)
            : std::map<std::string, std::string>{};
  if (ranks_.worldSize == 1) {
    TensorFile file;
    for (auto& [name, full] : wholeFromPieces(layout, pieces, split)) {
      file.tensors.emplace_back(
          name, full.to(detail::exportedDtype(full.scalar_type(), options_.outputDtype)));
    }
    file.metadata = metadata;
    writeTensorFile(path, file);
    return path;
  }
  shard::AgreementRequest request;
  request.api = std::string(kFinishApi) + "::onTrainEnd";
  request.consequence = "no deployable weights were written";
  // A gather's checks failed so before: keep the type callers saw.
  request.failureIsValueError = true;
  agreeOnSolves(*ranks_.comm, synth ? &synth->weights : nullptr, localError, request);
  // The gather assembles each tensor from its spec's rows: a tensor-
  // parallel piece (in its own layout) goes with its split dim moved
  // first, and the writer moves it back.
  std::vector<detail::ExportedTensor> tensors;
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const shard::ShardSpec& spec = layout.specs[i];
    const int64_t dim = splitDimOf(split, spec.name);
    tensors.push_back({{}, dim});
    if (dim == 0 || pieces.empty()) continue;
    pieces[i] = pieces[i]
                    .view(averager_->shards()[i].local.sizes())
                    .movedim(dim, 0)
                    .contiguous()
                    .view({-1});
  }
  shard::GatherOptions gather;
  gather.root = 0;
  gather.bufferBytes = options_.bufferBytes;
  detail::exportPieces(*ranks_.comm, path, layout, pieces, options_.outputDtype, metadata, gather,
                       "PostHocCallback::onTrainEnd", tensors);
  return ranks_.rank == 0 ? path : "";
}

}  // namespace shardema
