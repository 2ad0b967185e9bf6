#pragma once
// Averager: the EMA of a set of named tensors (one model, one profile).
// (Just over the 400-line guideline: one class's contract, each member
// saying who owns what, whether it blocks and which thread runs it.)
//
// Two storages (AveragerOptions::storage):
//   - kPinnedHost (default, DESIGN.md section 2): the EMA lives in host memory
//     from a PinnedArena; update() queues the work, the copy engine moves
//     the sources into bounded staging slots and the worker pool folds them
//     in. update() returns at once; fence() returns once the sources have
//     been read (call it before the sources change: before the next
//     optimizer.step(), EmaCallback::onBeforeOptimizerStep()), wait() once
//     the math is done. What a source written in place before fence()
//     does is options.sourceWrites' choice (SourceWrites: the update fails,
//     or the source is read inside update() from then on); torn values are
//     never folded in silently. Tensors marked changesInForward (buffers) are
//     read synchronously inside update() into a host snapshot, so the
//     forward pass may change them at once. offload.fenceInUpdate = true
//     makes update() call fence() itself (safe, but nothing overlaps the
//     next forward and backward). No device memory is used.
//   - kDevice: the EMA lives on the sources' device and update() runs there
//     synchronously with ATen ops, one tensor at a time: the comparison
//     mode. fence() and wait() return at once.
// Every call that reads or writes the EMA (ema, emaTensors, state, save,
// copyTo, loadEmaValues, loadState, load, the destructor) first
// waits for an update in flight.
//
// Threads. One Averager is used by one thread at a time (the training
// loop): none of its calls may run concurrently with another call on the
// same Averager, const ones included (ema(), state() and every call that
// waits may mark it failed). Handing it to another thread between calls is
// fine. Separate Averagers may be used from separate threads at once, even
// over one WorkerPool. With kPinnedHost the copies run on the copy engine's
// thread (the host engine's copy thread, or CUDA's callback thread) and the
// math on options.pool's workers; neither runs user code, and the sources
// are read on those threads between update() and fence(). With kDevice
// everything runs on the calling thread.
//
// Profiles. Calls that read or load one profile's EMA take `int profile =
// 0` (profile 0 is options.schedule, profile p options.moreSchedules[p - 1];
// c10::IndexError naming the call for another value): ema, emaTensors,
// lastDecay, schedule, loadEmaValues.
//
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardema/core/decay_schedule.h"
#include "shardema/core/tensor_file.h"
#include "shardema/offload/engine_choice.h"
#include "shardema/offload/pipeline_stats.h"
#include "shardema/tracking_policy.h"

namespace shardema {

namespace offload {
class WorkerPool;
}  // namespace offload

namespace detail {
class EmaStore;
struct EmaUpdate;
}  // namespace detail

/// Where the EMA lives and how it is updated (see the file comment).
enum class EmaStorage {
  /// Host memory, asynchronous chunked pipeline (default).
  kPinnedHost,
  /// The sources' device, synchronous ATen ops on the caller.
  kDevice,
};

/// What a kPinnedHost Averager does when a source is written in place while
/// a background update may still read it (between update() and fence()).
/// Writes are seen through autograd version counters (TrackedTensor::
/// writeVersion where they go through another tensor, a DTensor's).
enum class SourceWrites {
  /// The caller fences: fence() before the sources change (before the
  /// optimizer step). An update() with neither fence() nor wait() since the
  /// previous due one, or a source written before fence(), fails the update
  /// and marks the Averager failed (restore a state to continue). The C++
  /// default: LibTorch's C++ optimizers write through tensor.data(), whose
  /// version counter is not the tensor's, so only the fence can make their
  /// writes safe.
  kFenceRequired,
  /// Nothing fails for a write; what is written is read inside update()
  /// instead (the Python front's choice, where an in-place write through a
  /// tensor, the optimizer's included, bumps its version counter):
  ///   - the first due update reads every source before it returns;
  ///   - at the first call that fences or waits after a due update
  ///     (fence(), wait(), the next update(), ema(), ...), a source whose
  ///     version moved since that update (a write after update() and before
  ///     the next fence: weight clipping after the step, or any write when
  ///     nothing fenced) is read inside update() from then on, as
  ///     changesInForward tensors are, and one warning names it;
  ///   - where that write may have overlapped the background read (a chunk
  ///     check saw the source move before its read ended, or the engine
  ///     cannot tell: CUDA, whose copies run after the host moved on), the
  ///     warning also says that the EMA of that step may mix the values from
  ///     before and after the write.
  /// A loop that writes the same tensors at every step is exact from its
  /// first step on, and one that fences before its writes keeps every read
  /// in the background.
  kAdaptive,
};

/// The pipeline of the kPinnedHost storage.
struct AveragerOffloadOptions {
  /// Bytes per staging slot and per direct chunk (default 8 MiB,
  /// offload::kDefaultChunkBytes, >= 64). Larger chunks cost fewer copy
  /// calls and hand-offs per update but fill the pipeline later (the first
  /// math waits for the first whole chunk), hold more staging memory and,
  /// once two no longer fit in the last-level cache, are read back from
  /// memory instead of the cache (see kDefaultChunkBytes for the trade-off).
  int64_t chunkBytes = int64_t{8} << 20;
  /// Staging slots (default 4, offload::kDefaultNumSlots; 2 is double
  /// buffering). More slots let copies run further ahead of the math when
  /// their rates vary, each for up to chunkBytes more staging. Staging is
  /// allocated at the first update that stages (device sources) and held
  /// for the Averager's life: at most numSlots x chunkBytes (32 MiB by
  /// default), less for a model of fewer chunks, none for a model in host
  /// memory (offload/update_pipeline.h, "Staging memory").
  int numSlots = 4;
  /// false (default, DESIGN.md section 2): update() returns at once and the
  /// caller calls fence() before the sources change (update after the
  /// optimizer step, fence before the next one), so the copies overlap the
  /// next forward and backward passes. A source written in place before
  /// fence() fails the update (wait() throws naming it). true: update()
  /// returns once the sources have been read (it calls fence()), so they may
  /// change as soon as it returns, as with a synchronous update; the math
  /// still runs in the background until wait(). With bounded staging that
  /// waits for all but the last numSlots chunks' math.
  bool fenceInUpdate = false;
  /// Copy engine: kAuto (default) takes CUDA when a device is present.
  offload::EngineChoice engine = offload::EngineChoice::kAuto;
};

struct AveragerOptions {
  /// Decay as a function of the 1-based optimizer step. Default: the
  /// VersatIL warmup (power 0.75, max 0.9999).
  DecaySchedule schedule = DecaySchedule::warmup();
  /// Threads for the update kernels; not owned, must outlive the Averager.
  /// nullptr (default) uses offload::WorkerPool::shared().
  offload::WorkerPool* pool = nullptr;
  /// true (default, ema-pytorch/nitrous): the first due update copies the
  /// sources, whatever the decay. false (VersatIL's deepcopy at fit start):
  /// the construction-time copy is the start of the average and every due
  /// update lerps with the scheduled decay.
  bool copyOnFirstUpdate = true;
  /// Where the EMA lives. Default kPinnedHost. With kPinnedHost the pool
  /// needs at least one worker (c10::ValueError otherwise).
  EmaStorage storage = EmaStorage::kPinnedHost;
  /// Pipeline settings (kPinnedHost only).
  AveragerOffloadOptions offload;
  /// Further EMA profiles of the same tensors, updated in the same pass as
  /// the first (post-hoc EMA: one power-function schedule per sigma_rel, so
  /// k profiles stage and read each source once). Profile 0 is `schedule`,
  /// profile p its moreSchedules[p - 1]. Every schedule must have the same
  /// updateEvery (they share the due steps); at most kMaxProfiles - 1
  /// (shardema/core/update_kernels.h).
  /// Copy roles keep one copy shared by all profiles. Default: none.
  std::vector<DecaySchedule> moreSchedules;
  /// true: update() first checks every floating source it will read for
  /// NaN and Inf, and refuses the step (c10::ValueError naming the tensor,
  /// the EMA unchanged). It costs one more read of the weights on the
  /// calling thread. false (default, as ema-pytorch, timm and torch's
  /// AveragedModel): non-finite weights are averaged like any other.
  bool refuseNonFinite = false;
  /// What a source written before fence() does (kPinnedHost; see
  /// SourceWrites). Default kFenceRequired.
  SourceWrites sourceWrites = SourceWrites::kFenceRequired;
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

/// What the metadata of an Averager state records (Averager::state() and
/// save(); every rank file of a sharded checkpoint carries the same keys).
struct AveragerStateInfo {
  DecaySchedule schedule = DecaySchedule::warmup();
  int64_t step = 0;
  double lastDecay = 0.0;
  bool initialized = false;
  /// The role each tensor was saved with; empty when shardema.roles is absent.
  std::map<std::string, TrackRole> roles;
  /// One profile's schedule and last decay.
  struct Profile {
    DecaySchedule schedule = DecaySchedule::warmup();
    double lastDecay = 0.0;
  };
  /// Every profile saved, profile 0 (`schedule`, `lastDecay`) first: from
  /// shardema.profiles when the state has several, else profile 0 alone.
  std::vector<Profile> profiles;
};

/// The name a state file stores tensor `name` of `profile` under: `name`
/// for profile 0 (a one-profile state is unchanged), else
/// "shardema.profile_<p>/<name>" (docs/files.md). Only averaged tensors
/// have profiles beyond 0: copies are shared by every profile and saved once.
std::string profileTensorName(const std::string& name, int profile);
/// profileTensorName's inverse: the profile a stored name belongs to, with
/// the tracked name put in `*name` (profile 0 and the name itself for a
/// name without the prefix; -1 for a prefix that does not parse).
int profileOfStoredName(const std::string& stored, std::string* name);

/// The checks Averager::loadState makes of a state's metadata before it
/// looks at the tensors; `shardema inspect` and inspectCheckpoint make them
/// too, so no tool passes a state that loading refuses. shardema.kind is
/// averager_state; shardema.schedule a valid DecaySchedule JSON;
/// shardema.step plain decimal digits within int64; shardema.last_decay a
/// finite number in [0, 1]; shardema.initialized true or false;
/// shardema.roles, when present, a JSON object of tensor names to role
/// names; shardema.profiles, when present (a state of 2 or more profiles),
/// a JSON array of {"schedule", "last_decay"} per profile whose first entry
/// repeats shardema.schedule and shardema.last_decay; then
/// shardema.state_xxh64, when present (state() writes it), the XXH64 of
/// those keys and their values: a role or schedule edited to
/// another valid value, which only the Averager loaded into could refuse
/// (checkRoles, the schedule), fails here for every reader. c10::ValueError
/// "<api>: <key> ..." naming the key and its text.
AveragerStateInfo checkAveragerStateMetadata(const std::map<std::string, std::string>& metadata,
                                             const char* api);

class Averager {
 public:
  /// Copies every source once (the EMA starts equal to the model, as a
  /// deepcopy would). Names must be unique and non-empty; averaged sources
  /// must be float32, bfloat16 or float16 (c10::ValueError / TypeError naming
  /// the tensor), copies of a dtype tensor files hold (not complex: TypeError),
  /// and every source dense with values (meta or sparse: ValueError). A
  /// failure part-way (an allocation) releases what was built. Sources may
  /// live on any device; EMA storage is host memory (kPinnedHost) or the
  /// source's device (kDevice). The Averager holds the
  /// sources (tensor handles) and owns the EMA storage, its engine and
  /// staging memory; options.pool is borrowed.
  Averager(std::vector<TrackedTensor> tensors, AveragerOptions options = {});
  Averager(const Averager&) = delete;
  Averager& operator=(const Averager&) = delete;
  /// Moves take the EMA and the update in flight along; a moved-from
  /// Averager may only be destroyed or assigned to (a call that reads,
  /// updates, saves or loads the EMA throws c10::Error saying so). Assigning to an
  /// Averager first retires its own update in flight (as the destructor).
  Averager(Averager&&) noexcept;
  Averager& operator=(Averager&&) noexcept;
  /// Waits for an update in flight; its error is only warned about (a
  /// destructor must not throw).
  ~Averager();

  /// Folds the sources' current values in as optimizer step `step` (1-based,
  /// strictly increasing: c10::ValueError otherwise). Does nothing and
  /// returns false when the schedule says the step is not due. The first due
  /// update copies; later ones lerp with weight 1 - decay (a decay of 0 is an
  /// exact copy). kPinnedHost: completes the previous update (which may
  /// throw its error), snapshots the changesInForward tensors (and, with
  /// SourceWrites::kAdaptive, the sources seen written before fence()),
  /// queues the rest and returns at once: the other sources should not be
  /// written before fence() (or once they are read, with fenceInUpdate; see
  /// SourceWrites for what a write does). With kFenceRequired an update()
  /// with neither fence() nor wait() (nor a call that waits) since the
  /// previous one is a forgotten fence: c10::Error, and the Averager is
  /// failed. kDevice: blocks until done.
  /// If it throws before queueing (a source of the wrong dtype, say),
  /// step() is unchanged and the update can be retried.
  bool update(int64_t step);
  /// Blocks until the update in flight has read every source, so they may
  /// change (the next optimizer step). The math may still run. A source
  /// written since update() is judged by options.sourceWrites (with
  /// kFenceRequired the update fails, reported by wait()). Adds the time it
  /// blocked to offloadStats().fenceWaitSeconds. Never throws a worker's
  /// error (wait() does). No-op for kDevice.
  void fence();
  /// Blocks until all math is done; rethrows a background error (c10::Error
  /// naming the tensor and step) and marks the Averager failed.
  void wait();
  /// Where the EMA lives.
  EmaStorage storage() const { return options_.storage; }
  /// Whether a background update failed (see the file comment).
  bool failed() const { return !failure_.empty(); }
  /// Whether this Averager holds an EMA (false once moved from).
  bool hasStorage() const { return store_ != nullptr; }
  /// Marks the Averager failed, as a failed background update does: every
  /// call but a load refuses until a state is loaded. For a collective load
  /// that succeeded here but failed on another rank, so that every rank is
  /// left as it was.
  void markFailed(const std::string& why) { failure_ = why.empty() ? "marked failed" : why; }
  /// Pipeline counters (zero for kDevice): staging bytes, fence waits, ...
  /// Does not wait.
  offload::PipelineStats offloadStats() const;

  /// Last step passed to update() (0 before any).
  int64_t step() const { return step_; }
  /// Whether the first due update (the initial copy) has happened.
  bool initialized() const { return initialized_; }
  /// Profiles tracked: 1 + options.moreSchedules.size().
  int numProfiles() const { return static_cast<int>(options_.moreSchedules.size()) + 1; }
  /// Decay the profile used at the last due update (0 before any).
  double lastDecay(int profile = 0) const;
  /// The profile's schedule (0: options.schedule).
  const DecaySchedule& schedule(int profile = 0) const;

  /// Tracked names in construction order.
  std::vector<std::string> names() const;
  /// The tracked tensors update() reads before it returns (changesInForward
  /// ones, and those SourceWrites::kAdaptive moved there), in construction
  /// order. Does not wait.
  std::vector<std::string> readInsideUpdate() const;
  TrackRole role(const std::string& name) const;
  /// The EMA (averaging roles: float32) or the copy (kCopy/kCopyOnce:
  /// source dtype, one copy shared by every profile) of a tracked tensor in
  /// `profile`; a view of our storage, valid while the Averager lives.
  /// c10::IndexError naming the tensor when not tracked.
  const at::Tensor& ema(const std::string& name, int profile = 0) const;
  /// Every tracked tensor's EMA/copy in `profile`, in construction order
  /// (views). Both wait for the update in flight first; with kPinnedHost
  /// the next update() writes these views in the background, so clone what
  /// you keep across updates.
  std::vector<std::pair<std::string, at::Tensor>> emaTensors(int profile = 0) const;
  /// The live sources, in construction order (handles, not copies).
  std::vector<TrackedTensor> tracked() const;
  /// Follows a tracked tensor that was replaced by another of the same
  /// shape, dtype and device (a new nn.Parameter, `p.data = ...`): the next
  /// update reads `source`. c10::ValueError naming the tensor and what
  /// differs otherwise, before anything changes. An update in flight keeps
  /// reading the old source until fence().
  /// `newWriter`: writes to `source` bump its own version counter, not the
  /// one TrackedTensor::writeVersion named (a new tensor, not a detached
  /// alias of the old one), which is then dropped.
  void rebindSource(const std::string& name, const at::Tensor& source, bool newWriter = false);
  /// The dtype and shape of a tracked tensor's EMA storage (fixed at
  /// construction). Does not wait, so it also answers on a failed Averager
  /// (a load checks a file against it).
  std::pair<c10::ScalarType, std::vector<int64_t>> emaDtypeAndShape(const std::string& name) const;

  /// Sets the progress a resume from snapshots restores (loadState() does
  /// it from its metadata): the last step and whether the first copy
  /// happened. The step must be >= 0. Waits for the update in flight.
  void restoreProgress(int64_t step, bool initialized);

  /// Writes the EMA of `profile` into the sources (dtype and device
  /// converted), e.g. to evaluate with EMA weights; kPinnedHost goes
  /// through the copy engine. c10::IndexError for a profile that does not
  /// exist. Blocks.
  void copyTo(int profile = 0);
  /// Overwrites the EMA values of `profile` from named tensors (converted
  /// to our dtype; copy roles: the shared copy), e.g. from a post-hoc
  /// snapshot on resume; shapes must match (c10::ValueError naming the
  /// tensor); a floating EMA or copy takes floating values, an integer or
  /// bool copy only its own dtype (c10::TypeError naming the tensor).
  /// Checks everything before the first write. Waits.
  LoadReport loadEmaValues(const std::vector<std::pair<std::string, at::Tensor>>& values,
                           LoadStrictness strictness, int profile = 0);

  /// State for resume: every EMA tensor under its name, metadata with the
  /// step, initialised flag, last decay, schedule (JSON) and roles. With
  /// moreSchedules, every profile: each averaged tensor of profile p > 0
  /// under profileTensorName(name, p), and shardema.profiles with each
  /// profile's schedule and last decay.
  TensorFile state() const;
  /// state()'s metadata alone, read now: does not wait, so a failed
  /// Averager answers too (a load checks what it is given against it).
  std::map<std::string, std::string> stateMetadata() const;
  /// Restores state(): tensors as loadEmaValues, plus step and flags. In
  /// strict mode a schedule different from ours, or another number of
  /// profiles or another schedule of one, is an error naming both (a
  /// non-strict load takes the profiles both have). Checks everything
  /// before the first write.
  LoadReport loadState(const TensorFile& file, LoadStrictness strictness = LoadStrictness::kStrict);
  /// state() to a crash-safe safetensors file / loadState from one (whose
  /// errors then start with the file's path).
  void save(const std::string& path) const;
  LoadReport load(const std::string& path, LoadStrictness strictness = LoadStrictness::kStrict);

 private:
  void checkProfile(int profile, const char* api) const;
  size_t indexOf(const std::string& name, const char* api) const;
  void checkRoles(const std::map<std::string, TrackRole>& saved) const;
  void checkSavedProfiles(const std::vector<AveragerStateInfo::Profile>& saved) const;
  // Throws when failed; otherwise waits for the update in flight and turns
  // its error into the failed mark.
  void settle(const char* api) const;
  void checkNotFailed(const char* api) const;
  // A load's two halves: every check (names, shapes, dtypes; averagedOnly:
  // the copies, shared by every profile, are not expected), then the
  // writes, so that a load refused leaves the EMA as it was.
  LoadReport checkValues(const std::vector<std::pair<std::string, at::Tensor>>& values,
                         LoadStrictness strictness, bool averagedOnly) const;
  void writeValues(const std::vector<std::pair<std::string, at::Tensor>>& values, int profile);
  void rejectUnfenced(int64_t step);
  // The sources written since the last due update, judged once, at the
  // first call that fences or waits after it (options_.sourceWrites).
  void judgeWrites() const;
  void checkFinite(const detail::EmaUpdate& plan, int64_t step) const;
  detail::EmaStore& store(const char* api) const;

  AveragerOptions options_;
  std::vector<TrackedTensor> tracked_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tracked_
  int64_t step_ = 0;
  bool initialized_ = false;
  double lastDecay_ = 0.0;
  std::vector<double> moreLastDecays_;  // profiles 1..
  // Why the Averager is failed; empty when it is not. Set by const calls
  // that wait (ema(), state()), hence mutable.
  mutable std::string failure_;
  // The writes of the last due update not yet judged (judgeWrites), and
  // whether that update read every source inside update(). Mutable for the
  // same reason as failure_: any call that waits is where they are judged.
  mutable bool writesToJudge_ = false;
  bool lastReadInsideUpdate_ = false;
  bool updatedOnce_ = false;  // a due update has been queued
  // The EMA storage and the update mechanics of options_.storage. Null
  // only in a moved-from Averager.
  std::unique_ptr<detail::EmaStore> store_;
};

}  // namespace shardema
