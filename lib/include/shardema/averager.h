#pragma once
// Averager: the EMA of a set of named tensors (one model, one profile).
//
// Today every update is synchronous on the calling thread plus the worker
// pool, with the EMA in host memory; fence() and wait() are already part of
// the contract so callers are written for the asynchronous pipeline
// (DESIGN section 2) that the offload placement brings.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardema/decay_schedule.h"
#include "shardema/tensor_file.h"
#include "shardema/tracking_policy.h"

namespace shardema {

class WorkerPool;

struct AveragerOptions {
  /// Decay as a function of the 1-based optimizer step. Default: the
  /// VersatIL warmup (power 0.75, max 0.9999).
  DecaySchedule schedule = DecaySchedule::warmup();
  /// Threads for the update kernels; not owned, must outlive the Averager.
  /// nullptr (default) uses WorkerPool::shared().
  WorkerPool* pool = nullptr;
  /// true (default, ema-pytorch/nitrous): the first due update copies the
  /// sources, whatever the decay. false (VersatIL's deepcopy at fit start):
  /// the construction-time copy is the start of the average and every due
  /// update lerps with the scheduled decay.
  bool copyOnFirstUpdate = true;
};

/// How load() treats names that differ between a file and the Averager.
enum class LoadStrictness {
  /// Missing or unexpected names are an error listing them (default).
  kStrict,
  /// Names present on both sides are loaded; the others are reported by the
  /// returned LoadReport and left as they are.
  kNonStrict,
};

struct LoadReport {
  std::vector<std::string> missing;     // tracked here, absent in the file
  std::vector<std::string> unexpected;  // in the file, not tracked here
};

class Averager {
 public:
  /// Copies every source once (the EMA starts equal to the model, as a
  /// deepcopy would). Names must be unique and non-empty; averaged sources
  /// must be float32, bfloat16 or float16 (c10::ValueError / TypeError naming
  /// the tensor). Sources may live on any device; EMA storage is host memory.
  Averager(std::vector<TrackedTensor> tensors, AveragerOptions options = {});
  Averager(const Averager&) = delete;
  Averager& operator=(const Averager&) = delete;
  Averager(Averager&&) noexcept;
  Averager& operator=(Averager&&) noexcept;
  ~Averager();

  /// Folds the sources' current values in as optimizer step `step` (1-based,
  /// strictly increasing: c10::ValueError otherwise). Does nothing and
  /// returns false when the schedule says the step is not due. The first due
  /// update copies; later ones lerp with weight 1 - decay (a decay of 0 is an
  /// exact copy). Blocks until done (see the file comment). If it throws
  /// (a source of the wrong dtype, say), step() is unchanged and the update
  /// can be retried.
  bool update(int64_t step);
  /// Returns once the sources may change again (all copies taken).
  void fence() {}
  /// Returns once all math is done; rethrows a background error.
  void wait() {}

  /// Last step passed to update() (0 before any).
  int64_t step() const { return step_; }
  /// Whether the first due update (the initial copy) has happened.
  bool initialized() const { return initialized_; }
  /// Decay used by the last due update (0 before any).
  double lastDecay() const { return lastDecay_; }
  const DecaySchedule& schedule() const { return options_.schedule; }

  /// Tracked names in construction order.
  std::vector<std::string> names() const;
  TrackRole role(const std::string& name) const;
  /// The EMA (averaging roles: float32) or the copy (kCopy/kCopyOnce: source dtype)
  /// of a tracked tensor; a view of our storage, valid while the Averager
  /// lives. c10::IndexError naming the tensor when not tracked.
  const at::Tensor& ema(const std::string& name) const;
  /// Every tracked tensor's EMA/copy, in construction order (views).
  std::vector<std::pair<std::string, at::Tensor>> emaTensors() const;
  /// The live sources, in construction order (handles, not copies).
  std::vector<TrackedTensor> tracked() const;

  /// Writes the EMA into the sources (dtype and device converted), e.g. to
  /// evaluate with EMA weights. Blocks.
  void copyEmaToSources();
  /// Overwrites EMA values from named tensors (converted to our dtype);
  /// shapes must match (c10::ValueError naming the tensor).
  LoadReport loadEmaValues(const std::vector<std::pair<std::string, at::Tensor>>& values,
                           LoadStrictness strictness);

  /// State for resume: every EMA tensor under its name, metadata with the
  /// step, initialised flag, last decay, schedule (JSON) and roles.
  TensorFile state() const;
  /// Restores state(): tensors as loadEmaValues, plus step and flags. In
  /// strict mode a schedule different from ours is an error naming both.
  LoadReport loadState(const TensorFile& file, LoadStrictness strictness = LoadStrictness::kStrict);
  /// state() to a crash-safe safetensors file / loadState from one.
  void save(const std::string& path) const;
  LoadReport load(const std::string& path, LoadStrictness strictness = LoadStrictness::kStrict);

 private:
  struct Slot {
    TrackedTensor tracked;
    at::Tensor ema;  // host, contiguous
  };
  const Slot& slot(const std::string& name, const char* api) const;
  void copyAll(bool includeCopyOnce);
  void checkRoles(const TensorFile& file) const;
  void lerpAveraged(double weight);

  AveragerOptions options_;
  std::vector<Slot> slots_;
  std::unordered_map<std::string, size_t> index_;
  int64_t step_ = 0;
  bool initialized_ = false;
  double lastDecay_ = 0.0;
};

}  // namespace shardema
