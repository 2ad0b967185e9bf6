// PostHocCallback: the validation swap of the synthesized defaultOutputSigma
// and the end of training (final snapshot, synthesis, deployable weights).
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <unordered_map>

#include "sharded_internal.h"
#include "shardema/posthoc_callback.h"
#include "shardema/posthoc_folder_synthesis.h"
#include "shardema/posthoc_snapshot_synthesis.h"
#include "shardema/shard/communicator.h"
#include "shardema/tensor_file.h"

namespace shardema {
namespace {

constexpr const char* kApi = "PostHocCallback";

FolderSynthesisOptions synthesisOptions(const PostHocCallbackOptions& o, int64_t step,
                                        c10::ScalarType dtype) {
  FolderSynthesisOptions out;
  out.sigmaRel = o.defaultOutputSigma;
  out.step = step;
  out.normalize = o.normalize;
  out.dtype = dtype;
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
// from the same snapshot set: [ok, used snapshots, target step, sum bits].
at::Tensor solveFingerprint(const SynthesisWeights* weights) {
  at::Tensor out = at::zeros({4}, at::kLong);
  if (weights == nullptr) return out;
  int64_t used = 0;
  for (bool u : weights->used) used += u ? 1 : 0;
  int64_t sumBits = 0;
  std::memcpy(&sumBits, &weights->sum, sizeof sumBits);
  int64_t* data = out.data_ptr<int64_t>();
  data[0] = 1;
  data[1] = used;
  data[2] = weights->targetStep;
  data[3] = sumBits;
  return out;
}

}  // namespace

bool PostHocCallback::onValidationStart() {
  TORCH_CHECK(averager_ != nullptr, kApi, "::onValidationStart: called before onFitStart");
  TORCH_CHECK(!emaSwappedIn(), kApi, "::onValidationStart: the EMA is already swapped in");
  // The swap writes the tracked tensors: no update may still be reading them.
  wait();
  if (newestSnapshot_ == 0) return false;
  if (options_.placement == PostHocPlacement::kSharded) return swapInSharded();
  return swapInRankZero();
}

void PostHocCallback::onValidationEnd() {
  if (!emaSwappedIn()) return;
  torch::NoGradGuard noGrad;
  std::unordered_map<std::string, at::Tensor> raw = byName(rawDuringValidation_);
  for (TrackedTensor& target : swapTargets_) {
    const auto found = raw.find(target.name);
    if (found != raw.end()) target.source.copy_(found->second);
  }
  rawDuringValidation_.clear();
}

bool PostHocCallback::swapInSharded() {
  const std::vector<SnapshotEntry> entries =
      scanRankSnapshots(options_.checkpointFolder, ranks_.rank);
  const SynthesizedTensors synth =
      synthesizeSnapshots(entries, synthesisOptions(options_, newestSnapshot_, at::kFloat));
  const std::unordered_map<std::string, at::Tensor> values = byName(synth.tensors);
  NamedTensors raw;
  for (const TrackedTensor& target : swapTargets_) {
    if (!at::isFloatingType(target.source.scalar_type())) continue;
    const auto found = values.find(target.name);
    TORCH_CHECK_VALUE(found != values.end() && found->second.numel() == target.source.numel(), kApi,
                      "::onValidationStart: the snapshots in ", snapshotFolder(),
                      " do not hold this rank's '", target.name, "'");
    raw.emplace_back(target.name, target.source.detach().clone());
  }
  torch::NoGradGuard noGrad;
  for (const TrackedTensor& target : swapTargets_) {
    if (!at::isFloatingType(target.source.scalar_type())) continue;
    target.source.copy_(values.at(target.name).view(target.source.sizes()));
  }
  rawDuringValidation_ = std::move(raw);
  return true;
}

bool PostHocCallback::swapInRankZero() {
  const bool collective = ranks_.worldSize > 1;
  TORCH_CHECK_VALUE(!collective || ranks_.comm != nullptr, kApi,
                    "::onValidationStart: with worldSize ", ranks_.worldSize,
                    " the rank-0 placement broadcasts the synthesized weights and needs "
                    "ranks.comm");
  // Rank 0 synthesizes, then says whether it could before any tensor moves,
  // so a failure there fails every rank at once instead of a timeout.
  std::unordered_map<std::string, at::Tensor> values;
  std::exception_ptr failure;
  at::Tensor ok = at::ones({1}, at::kInt);
  if (ranks_.rank == 0) {
    try {
      const SnapshotFolder folder = scanSnapshotFolder(options_.checkpointFolder);
      values = byName(synthesizeSnapshots(folder.snapshots,
                                          synthesisOptions(options_, newestSnapshot_, at::kFloat))
                          .tensors);
    } catch (...) {
      failure = std::current_exception();
      ok.fill_(0);
    }
  }
  if (collective) ranks_.comm->broadcast(ok, 0, "PostHocCallback validation synthesis");
  if (failure) std::rethrow_exception(failure);
  TORCH_CHECK(ok.item<int>() == 1, kApi,
              "::onValidationStart: rank 0 could not synthesize the EMA (see its error)");
  NamedTensors raw;
  torch::NoGradGuard noGrad;
  for (const TrackedTensor& target : swapTargets_) {
    if (!at::isFloatingType(target.source.scalar_type())) continue;
    at::Tensor value;
    if (ranks_.rank == 0) {
      const auto found = values.find(target.name);
      TORCH_CHECK(found != values.end(), kApi, "::onValidationStart: the snapshots hold no '",
                  target.name, "'");
      value = found->second.contiguous();
    } else {
      value = at::empty(target.source.sizes(), at::TensorOptions().dtype(at::kFloat));
    }
    if (collective) ranks_.comm->broadcast(value, 0, "PostHocCallback validation " + target.name);
    raw.emplace_back(target.name, target.source.detach().clone());
    target.source.copy_(value.view(target.source.sizes()));
  }
  rawDuringValidation_ = std::move(raw);
  return true;
}

std::string PostHocCallback::onTrainEnd() {
  TORCH_CHECK(averager_ != nullptr, kApi, "::onTrainEnd: called before onFitStart");
  TORCH_CHECK(!emaSwappedIn(), kApi, "::onTrainEnd: call onValidationEnd() first");
  if (calls_ == 0) {
    LOG(WARNING) << kApi << "::onTrainEnd: no call was counted (startIter " << options_.startIter
                 << "); nothing to synthesize";
    return "";
  }
  wait();
  if (calls_ != newestSnapshot_) writeSnapshots();
  if (options_.placement == PostHocPlacement::kSharded) return finishSharded();
  return finishRankZero();
}

std::string PostHocCallback::deployablePath() const {
  // The snapshot folder holds snapshots only (its scan refuses other
  // safetensors files), so by default the result goes beside it, as
  // nitrous writes {run_dir}/..._final next to {run_dir}/ema_ckpts.
  std::string folder = options_.outputFolder;
  if (folder.empty()) {
    std::filesystem::path snapshots =
        std::filesystem::path(options_.checkpointFolder).lexically_normal();
    if (snapshots.filename().empty()) snapshots = snapshots.parent_path();
    folder = snapshots.has_parent_path() ? snapshots.parent_path().string() : ".";
  }
  return detail::joinPath(
      folder, deployableFileName(options_.outputPrefix, options_.defaultOutputSigma, calls_));
}

std::string PostHocCallback::finishRankZero() {
  if (ranks_.rank != 0) return "";
  const std::string path = deployablePath();
  detail::ensureDirectory(std::filesystem::path(path).parent_path().string(), kApi);
  synthesizeSnapshotFolder(options_.checkpointFolder, path,
                           synthesisOptions(options_, calls_, options_.outputDtype));
  return path;
}

std::string PostHocCallback::finishSharded() {
  const std::string path = deployablePath();
  std::optional<SynthesizedTensors> synth;
  std::string localError;
  try {
    synth = synthesizeSnapshots(scanRankSnapshots(options_.checkpointFolder, ranks_.rank),
                                synthesisOptions(options_, calls_, at::kFloat));
    if (ranks_.rank == 0) {
      detail::ensureDirectory(std::filesystem::path(path).parent_path().string(), kApi);
    }
  } catch (...) {
    if (ranks_.worldSize == 1) throw;
    localError = detail::currentErrorMessage();
  }
  const shard::ShardLayout& layout = averager_->layout();
  std::vector<at::Tensor> pieces;
  if (synth) {
    const std::unordered_map<std::string, at::Tensor> values = byName(synth->tensors);
    for (const shard::ShardSpec& spec : layout.specs) {
      const auto found = values.find(spec.name);
      TORCH_CHECK_VALUE(found != values.end(), kApi, "::onTrainEnd: the snapshots of rank ",
                        ranks_.rank, " hold no '", spec.name, "'");
      pieces.push_back(found->second.reshape({-1}));
    }
  }
  const std::map<std::string, std::string> metadata =
      synth ? synthesizedMetadata(synth->weights, options_.normalize)
            : std::map<std::string, std::string>{};
  if (ranks_.worldSize == 1) {
    TensorFile file;
    for (size_t i = 0; i < layout.specs.size(); ++i) {
      at::Tensor full = pieces[i].reshape(layout.specs[i].globalShape);
      file.tensors.emplace_back(
          layout.specs[i].name,
          full.to(detail::exportedDtype(full.scalar_type(), options_.outputDtype)));
    }
    file.metadata = metadata;
    writeTensorFile(path, file);
    return path;
  }
  // Every rank must have solved the same system (a rank that lost a
  // snapshot would otherwise mix other weights into its shard).
  shard::Communicator& comm = *ranks_.comm;
  const at::Tensor mine = solveFingerprint(synth ? &synth->weights : nullptr);
  at::Tensor all = at::empty({4 * ranks_.worldSize}, at::kLong);
  comm.allGather(mine, all, "PostHocCallback synthesis check");
  const int64_t* f = all.data_ptr<int64_t>();
  for (int64_t r = 0; r < ranks_.worldSize && localError.empty(); ++r) {
    const bool same = std::memcmp(f + 4 * r + 1, f + 1, 3 * sizeof(int64_t)) == 0;
    if (f[4 * r] != 1 || !same) {
      localError = f[4 * r] != 1 ? "rank " + std::to_string(r) + " could not synthesize"
                                 : "rank " + std::to_string(r) +
                                       " synthesized from another snapshot set than rank 0";
    }
  }
  shard::GatherOptions gather;
  gather.root = 0;
  gather.bufferBytes = options_.bufferBytes;
  gather.localError = localError;
  detail::exportPieces(comm, path, layout, pieces, options_.outputDtype, metadata, gather,
                       "PostHocCallback::onTrainEnd");
  return ranks_.rank == 0 ? path : "";
}

}  // namespace shardema
