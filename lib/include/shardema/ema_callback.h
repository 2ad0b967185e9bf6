#pragma once
// EmaCallback: the warmup-EMA lifecycle of a trainer callback (DESIGN.md
// section 4, the VersatIL EMACallback), for a C++ training loop. Call the
// hooks where a Lightning trainer would; all of them run on the caller's
// thread. With the default storage (pinned host) the EMA math runs in the
// background after onTrainBatchEnd returns; the hooks that read the EMA
// (save, validation swap) wait for it first.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "shardema/averager.h"
#include "shardema/ema_substitution.h"
#include "shardema/training_checkpoint.h"
#include "shardema/weight_swap.h"

namespace shardema {

namespace offload {
class WorkerPool;
}  // namespace offload

struct EmaCallbackOptions {
  /// The warmup schedule; defaults follow VersatIL (power 0.75,
  /// update_after_step 0, inv_gamma 1, min 0, max 0.9999).
  WarmupScheduleOptions schedule;
  /// What is averaged and what is copied. Default: VersatIL.
  TrackingPolicy policy = TrackingPolicy::kVersatil;
  /// The decay logger is called on updates whose global step is a multiple
  /// of this. Default 100; 0 disables logging.
  int64_t logEveryNSteps = 100;
  /// Worker threads for the updates; not owned. nullptr: the shared pool.
  offload::WorkerPool* pool = nullptr;
  /// Where the EMA lives (AveragerOptions::storage). Default kPinnedHost.
  EmaStorage storage = EmaStorage::kPinnedHost;
  /// Pipeline settings for kPinnedHost. By default (fenceInUpdate = false)
  /// onTrainBatchEnd returns at once: the loop must call
  /// onBeforeOptimizerStep() before every optimizer step (forgetting it
  /// fails the update with an error saying so, never a silent wrong EMA).
  AveragerOffloadOptions offload;
};

/// Whether the training batch `batchIdx` (0-based in its epoch) ended with an
/// optimizer step: at the end of an accumulation window ((batchIdx + 1) %
/// accumulateGradBatches == 0) or on the epoch's last batch, where Lightning
/// steps on a window cut short. The one rule of EmaCallback, PostHocCallback
/// and the Python callbacks (shardema._C.optimizer_stepped): micro-batches
/// inside a window did not change the weights, and averaging them would
/// decay the EMA too fast. c10::ValueError when accumulateGradBatches < 1
/// or batchIdx < 0.
bool optimizerStepped(int64_t batchIdx, int64_t accumulateGradBatches, bool isLastBatch);

class EmaCallback {
 public:
  /// Called with (global step, decay); runs on the training thread.
  using DecayLogger = std::function<void(int64_t globalStep, double decay)>;

  explicit EmaCallback(EmaCallbackOptions options = {});
  void setDecayLogger(DecayLogger logger) { logger_ = std::move(logger); }

  /// Builds the EMA from `module` (which must outlive the callback's use of
  /// it), then applies an EMA state queued by onLoadCheckpoint, if any. On
  /// an error (a tensor that cannot be tracked, a queued state that does
  /// not load) the callback is left as before the call.
  void onFitStart(torch::nn::Module& module);
  /// After each training batch. Updates only when an optimizer step just
  /// happened: at the end of an accumulation window ((batchIdx + 1) %
  /// accumulateGradBatches == 0) or on the epoch's last batch. The decay
  /// comes from globalStep (optimizer steps done, 1-based). Returns whether
  /// the EMA was updated. c10::Error before onFitStart.
  bool onTrainBatchEnd(int64_t globalStep, int64_t batchIdx, int64_t accumulateGradBatches,
                       bool isLastBatch);
  /// Call before every optimizer step (before anything but the forward
  /// pass changes a tracked tensor again). Blocks until the last update has
  /// read the tensors (Averager::fence); the math may go on. Buffers (which
  /// the forward pass changes) are read inside onTrainBatchEnd and need no
  /// fence. Required by default; a cheap no-op with offload.fenceInUpdate =
  /// true. Does nothing before onFitStart.
  void onBeforeOptimizerStep();
  /// Blocks until the EMA math is done; rethrows a background error.
  void wait();
  /// substituteEma (ema_substitution.h) on the checkpoint: the EMA into
  /// checkpoint.weights at each entry's dtype (for every name it holds), the
  /// replaced raw values into checkpoint.rawWeights, the float32 EMA of the
  /// entries that narrowed it into checkpoint.float32Ema, plus the EMA
  /// progress in metadata. Not allowed while EMA weights are swapped in,
  /// nor twice on one checkpoint (c10::ValueError naming the tensor).
  void onSaveCheckpoint(TrainingCheckpoint& checkpoint) const;
  /// Restores the raw weights into `module` and queues the EMA for
  /// onFitStart: checkpoint.float32Ema where it has the name, else the
  /// weights. A checkpoint without raw weights is left alone.
  void onLoadCheckpoint(torch::nn::Module& module, const TrainingCheckpoint& checkpoint);
  /// Swap the EMA weights into the module / the raw weights back, through
  /// a WeightSwap (weight_swap.h): the raw weights wait in host memory, every
  /// Averager of the process is fenced first, and a module another swap
  /// holds is refused naming its holder. Blocks.
  void onValidationStart();
  void onValidationEnd();

  /// Decay of the last update (0 before any).
  double decay() const { return averager_ ? averager_->lastDecay() : 0.0; }
  bool hasEma() const { return averager_ != nullptr; }
  /// The EMA; c10::Error before onFitStart.
  const Averager& averager() const;
  bool emaSwappedIn() const { return swap_ != nullptr; }

 private:
  EmaCallbackOptions options_;
  DecayLogger logger_;
  torch::nn::Module* module_ = nullptr;
  std::unique_ptr<Averager> averager_;
  std::optional<TensorFile> queuedState_;
  // The validation swap (weight_swap.h): raw weights in host memory.
  std::unique_ptr<WeightSwap> swap_;
};

/// RAII: onValidationStart() now, onValidationEnd() when it goes out of
/// scope, so the raw weights come back even when validation throws.
class EmaValidationScope {
 public:
  explicit EmaValidationScope(EmaCallback& callback) : callback_(callback) {
    callback_.onValidationStart();
  }
  /// Never throws (it may run while an exception unwinds): a failure to
  /// restore is reported as a warning, and emaSwappedIn() stays true.
  ~EmaValidationScope();
  EmaValidationScope(const EmaValidationScope&) = delete;
  EmaValidationScope& operator=(const EmaValidationScope&) = delete;

 private:
  EmaCallback& callback_;
};

}  // namespace shardema
