#include "shardema/ema_callback.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <unordered_map>

#include "sharded_internal.h"
#include "shardema/core/file_metadata.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/warning.h"
#include "shardema/module_tracking.h"

namespace shardema {
namespace {

// The averager's progress travels in the checkpoint's metadata under this
// prefix, next to (not mixed with) the trainer's own keys.
constexpr const char* kEmaMetadataPrefix = detail::kEmaCallbackPrefix;
constexpr const char* kLibraryPrefix = kMetadataPrefix;

std::string withoutPrefix(const std::string& key, const std::string& prefix) {
  return key.compare(0, prefix.size(), prefix) == 0 ? key.substr(prefix.size()) : std::string();
}

}  // namespace

EmaCallback::EmaCallback(EmaCallbackOptions options) : options_(std::move(options)) {
  TORCH_CHECK_VALUE(options_.logEveryNSteps >= 0, "EmaCallback: logEveryNSteps must be >= 0, got ",
                    options_.logEveryNSteps);
  DecaySchedule::warmup(options_.schedule);  // validate now, not at the first fit
}

// Everything is built aside and committed at the end: a throw (a tensor
// that cannot be tracked, a queued state that does not load) leaves the
// callback as it was, with the queued state still queued, never with an
// EMA that silently skipped the resume.
void EmaCallback::onFitStart(torch::nn::Module& module) {
  AveragerOptions averagerOptions;
  averagerOptions.schedule = DecaySchedule::warmup(options_.schedule);
  averagerOptions.pool = options_.pool;
  averagerOptions.storage = options_.storage;
  averagerOptions.offload = options_.offload;
  // VersatIL deep-copies the model here and every optimizer step then
  // lerps with the scheduled decay (which is 0, an exact copy, early on).
  averagerOptions.copyOnFirstUpdate = false;
  auto averager = std::make_unique<Averager>(trackModule(module, options_.policy), averagerOptions);
  if (queuedState_) {
    if (queuedState_->metadata.count(detail::kKindKey)) {
      averager->loadState(*queuedState_, LoadStrictness::kNonStrict);
    } else {
      averager->loadEmaValues(queuedState_->tensors, LoadStrictness::kNonStrict);
    }
  }
  module_ = &module;
  averager_ = std::move(averager);
  queuedState_.reset();
}

bool optimizerStepped(int64_t batchIdx, int64_t accumulateGradBatches, bool isLastBatch) {
  TORCH_CHECK_VALUE(accumulateGradBatches >= 1,
                    "accumulateGradBatches (the trainer's accumulate_grad_batches) must be >= 1, "
                    "got ",
                    accumulateGradBatches);
  TORCH_CHECK_VALUE(batchIdx >= 0, "batchIdx (the batch's index in its epoch) must be >= 0, got ",
                    batchIdx);
  return (batchIdx + 1) % accumulateGradBatches == 0 || isLastBatch;
}

bool EmaCallback::onTrainBatchEnd(int64_t globalStep, int64_t batchIdx,
                                  int64_t accumulateGradBatches, bool isLastBatch) {
  // Checked before the state: a bad argument is a ValueError even before
  // onFitStart.
  const bool stepped = optimizerStepped(batchIdx, accumulateGradBatches, isLastBatch);
  // Before onFitStart there is no EMA to fold this step into; returning
  // false would let a loop that forgot onFitStart train without one.
  TORCH_CHECK(averager_ != nullptr, "EmaCallback::onTrainBatchEnd: called before onFitStart; ",
              "call onFitStart(module) once before the first batch");
  TORCH_CHECK(!emaSwappedIn(),
              "EmaCallback::onTrainBatchEnd: called while the EMA weights are "
              "swapped in; call onValidationEnd() first");
  if (!stepped) return false;
  // A global step that did not advance (manual optimisation that skipped a
  // step, a trainer whose counter was reset) is not an optimizer step to
  // fold in; the seed would average it again, we skip it instead of
  // stopping training.
  if (globalStep <= averager_->step()) return false;
  const bool updated = averager_->update(globalStep);
  if (updated && logger_ && options_.logEveryNSteps > 0 &&
      globalStep % options_.logEveryNSteps == 0) {
    logger_(globalStep, averager_->lastDecay());
  }
  return updated;
}

void EmaCallback::onBeforeOptimizerStep() {
  if (averager_) averager_->fence();
}

void EmaCallback::wait() {
  if (averager_) averager_->wait();
}

void EmaCallback::onSaveCheckpoint(TrainingCheckpoint& checkpoint) const {
  if (!averager_) return;
  TORCH_CHECK(!emaSwappedIn(),
              "EmaCallback::onSaveCheckpoint: the EMA weights are swapped in; "
              "save outside validation so the raw weights are the ones kept for resume");
  std::vector<std::string> rawKept;
  for (const auto& [name, raw] : checkpoint.rawWeights) rawKept.push_back(name);
  EmaSubstitution taken = substituteEma(checkpoint.weights, averager_->emaTensors(), rawKept);
  for (auto& entry : taken.raw) checkpoint.rawWeights.push_back(std::move(entry));
  for (auto& entry : taken.float32Ema) checkpoint.float32Ema.push_back(std::move(entry));
  for (const auto& [key, value] : averager_->state().metadata) {
    checkpoint.metadata[kEmaMetadataPrefix + withoutPrefix(key, kLibraryPrefix)] = value;
  }
}

void EmaCallback::onLoadCheckpoint(torch::nn::Module& module,
                                   const TrainingCheckpoint& checkpoint) {
  if (checkpoint.rawWeights.empty()) return;
  // The EMA as averaged where the weights hold it narrowed (bf16 models;
  // files written before float32Ema existed hold it in the weights).
  std::unordered_map<std::string, const at::Tensor*> weights;
  for (const auto& [name, tensor] : checkpoint.weights) weights[name] = &tensor;
  for (const auto& [name, tensor] : checkpoint.float32Ema) weights[name] = &tensor;
  TensorFile queued;
  for (const auto& [name, raw] : checkpoint.rawWeights) {
    const auto it = weights.find(name);
    // A copy: the checkpoint's tensors may alias the module, which the raw
    // weights are about to overwrite.
    if (it != weights.end())
      queued.tensors.emplace_back(name, it->second->detach().to(at::kCPU).clone());
  }
  for (const auto& [key, value] : checkpoint.metadata) {
    const std::string rest = withoutPrefix(key, kEmaMetadataPrefix);
    if (!rest.empty()) queued.metadata[kLibraryPrefix + rest] = value;
  }
  loadIntoModule(module, checkpoint.rawWeights, LoadStrictness::kNonStrict);
  queuedState_ = std::move(queued);
}

void EmaCallback::onValidationStart() {
  if (!averager_) return;
  TORCH_CHECK(!emaSwappedIn(),
              "EmaCallback::onValidationStart: the EMA weights are already "
              "swapped in");
  // The math of the update in flight must be done before the EMA is
  // copied out (the swap itself fences every Averager before it writes).
  averager_->wait();
  NamedTensors targets;
  for (const TrackedTensor& t : averager_->tracked()) targets.emplace_back(t.name, t.source);
  swap_ = std::make_unique<WeightSwap>(std::move(targets), "EmaCallback");
  try {
    averager_->copyTo();
  } catch (...) {
    swap_.reset();  // a partial swap must not leave the module half EMA
    throw;
  }
}

void EmaCallback::onValidationEnd() {
  if (!emaSwappedIn()) return;
  swap_->restore();
  swap_.reset();
}

EmaValidationScope::~EmaValidationScope() {
  try {
    callback_.onValidationEnd();
  } catch (...) {
    detail::warn("EmaValidationScope: restoring the raw weights failed: " +
                 detail::currentErrorMessage());
  }
}

const Averager& EmaCallback::averager() const {
  TORCH_CHECK(averager_ != nullptr, "EmaCallback::averager: no EMA yet; call onFitStart first");
  return *averager_;
}

}  // namespace shardema
