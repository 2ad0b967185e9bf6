#include "shardema/averager.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <unordered_set>

#include "shardema/offload/pinned_arena.h"
#include "shardema/detail/tensor_update.h"
#include "shardema/offload/worker_pool.h"

namespace shardema {
namespace {

at::Tensor makeStorage(const TrackedTensor& tracked, const AveragerOptions& options,
                       offload::PinnedArena* arena) {
  const auto dtype = isAveragingRole(tracked.role) ? at::kFloat : tracked.source.scalar_type();
  at::Tensor storage =
      arena != nullptr
          ? arena->allocate(tracked.source.sizes(), dtype)
          : at::empty(tracked.source.sizes(),
                      at::TensorOptions().dtype(dtype).device(
                          options.placement == EmaPlacement::kDevice ? tracked.source.device()
                                                                     : at::Device(at::kCPU)));
  storage.copy_(tracked.source.detach());
  return storage;
}

void checkTracked(const TrackedTensor& tracked, std::unordered_set<std::string>& seen) {
  TORCH_CHECK_VALUE(!tracked.name.empty(), "Averager: a tracked tensor has an empty name");
  TORCH_CHECK_VALUE(seen.insert(tracked.name).second, "Averager: tensor '", tracked.name,
                    "' is tracked twice; names must be unique");
  TORCH_CHECK_VALUE(tracked.source.defined(), "Averager: tensor '", tracked.name,
                    "' has an undefined source");
  if (isAveragingRole(tracked.role)) {
    sourceTypeOf(tracked.source, tracked.name);  // float32/bfloat16/float16, else TypeError
  }
}

// What a due update does to one tensor: kCopyOnce tensors are left alone,
// copies are refreshed, averaged tensors lerp (or copy on the first update,
// with a zero decay, or while frozen).
enum class Action { kSkip, kLerp, kCopy };

Action actionFor(const TrackedTensor& tracked, bool firstCopy, bool weightIsOne) {
  if (tracked.role == TrackRole::kCopyOnce) return Action::kSkip;
  if (tracked.role == TrackRole::kCopy || firstCopy || weightIsOne) return Action::kCopy;
  const bool frozen =
      tracked.role == TrackRole::kAverageIfTrainable && !tracked.source.requires_grad();
  return frozen ? Action::kCopy : Action::kLerp;
}

}  // namespace

Averager::Averager(std::vector<TrackedTensor> tensors, AveragerOptions options)
    : options_(std::move(options)) {
  std::unordered_set<std::string> seen;
  for (const TrackedTensor& tracked : tensors) checkTracked(tracked, seen);
  TORCH_CHECK_VALUE(options_.moreSchedules.size() < static_cast<size_t>(kMaxProfiles),
                    "Averager: options.moreSchedules holds ", options_.moreSchedules.size(),
                    " schedules; at most ", kMaxProfiles - 1, " profiles can be added");
  for (size_t p = 0; p < options_.moreSchedules.size(); ++p) {
    TORCH_CHECK_VALUE(options_.moreSchedules[p].updateEvery() == options_.schedule.updateEvery(),
                      "Averager: options.moreSchedules[", p, "] updates every ",
                      options_.moreSchedules[p].updateEvery(), " steps but options.schedule every ",
                      options_.schedule.updateEvery(), "; profiles share their due steps");
  }
  moreLastDecays_.assign(options_.moreSchedules.size(), 0.0);
  if (options_.placement == EmaPlacement::kPinnedHost) {
    arena_ = std::make_unique<offload::PinnedArena>();
    engine_ = offload::makeCopyEngine(options_.offload.engine);
    offload::UpdatePipelineOptions pipeline;
    pipeline.chunkBytes = options_.offload.chunkBytes;
    pipeline.numSlots = options_.offload.numSlots;
    pipeline.pool = options_.pool;
    pipeline.engine = engine_.get();
    pipeline.arena = arena_.get();
    pipeline.fault = options_.offload.faultForTesting;
    pipeline_ = std::make_unique<offload::UpdatePipeline>(pipeline);
  }
  slots_.reserve(tensors.size());
  for (TrackedTensor& tracked : tensors) {
    at::Tensor storage = makeStorage(tracked, options_, arena_.get());
    index_.emplace(tracked.name, slots_.size());
    std::vector<at::Tensor> moreEmas;
    if (isAveragingRole(tracked.role)) {
      for (size_t p = 0; p < options_.moreSchedules.size(); ++p) {
        moreEmas.push_back(makeStorage(tracked, options_, arena_.get()));
      }
    }
    slots_.push_back(Slot{std::move(tracked), std::move(storage), at::Tensor(), std::move(moreEmas)});
  }
  initialized_ = !options_.copyOnFirstUpdate;
}

Averager::Averager(Averager&&) noexcept = default;
Averager& Averager::operator=(Averager&&) noexcept = default;
Averager::~Averager() {
  // Waits for an update in flight (an error is only warned about: a
  // destructor must not throw) while the engine still exists.
  pipeline_.reset();
}

void Averager::checkNotFailed(const char* api) const {
  TORCH_CHECK(failure_.empty(), "Averager::", api, ": this Averager is failed since a background ",
              "update failed (", failure_, "); its EMA is partly updated. Restore a saved state ",
              "with loadState() or load() to continue");
}

void Averager::settle(const char* api) const {
  checkNotFailed(api);
  if (!pipeline_) return;
  try {
    pipeline_->wait();
  } catch (const c10::Error& e) {
    failure_ = e.what_without_backtrace();
    TORCH_CHECK(false, "Averager::", api, ": ", failure_,
                ". The EMA is partly updated and this Averager is now failed: restore a saved "
                "state with loadState() or load() to continue");
  }
}

void Averager::fence() {
  if (pipeline_) pipeline_->fence();
}

void Averager::wait() { settle("wait"); }

offload::PipelineStats Averager::offloadStats() const {
  return pipeline_ ? pipeline_->stats() : offload::PipelineStats{};
}

bool Averager::update(int64_t step) {
  TORCH_CHECK_VALUE(step > step_, "Averager::update: step must increase; got step ", step,
                    " after step ", step_);
  if (pipeline_ && !pipeline_->sourcesReleased()) rejectUnfenced(step);
  settle("update");
  if (!options_.schedule.isDueAt(step)) {
    step_ = step;
    return false;
  }
  const double decay = options_.schedule.decayAt(step);
  std::vector<double> weights{1.0 - decay};
  std::vector<double> moreDecays;
  for (const DecaySchedule& schedule : options_.moreSchedules) {
    moreDecays.push_back(schedule.decayAt(step));
    weights.push_back(1.0 - moreDecays.back());
  }
  const bool firstCopy = !initialized_;
  if (pipeline_) {
    submitToPipeline(firstCopy, weights, step);
  } else {
    updateOnDevice(firstCopy, weights);
  }
  // Progress is recorded only once the update was accepted, so an update
  // refused on the caller can be retried at the same step.
  initialized_ = true;
  step_ = step;
  lastDecay_ = decay;
  moreLastDecays_ = std::move(moreDecays);
  return true;
}

// The previous update was neither fenced nor waited for, so whatever ran
// since (the optimizer step) may have written its sources while they were
// read. The version check cannot prove otherwise: LibTorch's C++ optimizers
// write through tensor.data(), which has its own version counter. So this
// is an error, the EMA counts as torn, and the loop must be fixed.
void Averager::rejectUnfenced(int64_t step) {
  settle("update");  // a written source seen by the version check comes first
  std::ostringstream why;
  why << "update(" << step << ") came without fence() or wait() since update(" << step_
      << "): its sources may have been modified before fence(): call Averager::fence() "
         "(EmaCallback::onBeforeOptimizerStep()) before optimizer.step()";
  failure_ = why.str();
  TORCH_CHECK(false, "Averager::update: ", failure_,
              ". This Averager is now failed: restore a saved state with loadState() or load() "
              "to continue");
}

namespace {

// A zero decay must reproduce the source exactly; ema + 1 * (x - ema) can
// be off by an ulp, so it becomes a copy (when every profile has it).
bool allWeightsOne(const std::vector<double>& weights) {
  for (double w : weights) {
    if (w != 1.0) return false;
  }
  return true;
}

}  // namespace

void Averager::submitToPipeline(bool firstCopy, const std::vector<double>& weights,
                                int64_t step) {
  const bool weightIsOne = allWeightsOne(weights);
  std::vector<offload::PipelineJob> jobs;
  jobs.reserve(slots_.size());
  // Everything is checked before the first snapshot is written.
  for (const Slot& s : slots_) {
    if (actionFor(s.tracked, firstCopy, weightIsOne) == Action::kSkip) continue;
    // TypeError before anything starts
    if (isAveragingRole(s.tracked.role)) sourceTypeOf(s.tracked.source, s.tracked.name);
    TORCH_CHECK_VALUE(s.tracked.source.sizes() == s.ema.sizes(), "Averager::update: tensor '",
                      s.tracked.name, "' has shape ", s.tracked.source.sizes(),
                      " but the EMA has shape ", s.ema.sizes());
  }
  for (Slot& s : slots_) {
    const Action action = actionFor(s.tracked, firstCopy, weightIsOne);
    if (action == Action::kSkip) continue;
    offload::PipelineJob job{s.ema, at::Tensor(), UpdateOp::kCopy, false, s.tracked.name, {}};
    if (isAveragingRole(s.tracked.role)) {
      job.moreEmas = s.moreEmas;
      job.source = pipelineSource(s, s.tracked.source.scalar_type());
      job.op = action == Action::kLerp ? UpdateOp::kLerp : UpdateOp::kCopy;
    } else {
      // Copies keep their dtype; a source that changed dtype is converted
      // (rare: a module cast after the Averager was built).
      job.source = pipelineSource(s, s.ema.scalar_type());
      job.rawCopy = true;
    }
    jobs.push_back(std::move(job));
  }
  std::vector<float> floatWeights(weights.begin(), weights.end());
  pipeline_->submit(std::move(jobs), std::move(floatWeights), step);
  if (options_.offload.fenceInUpdate) pipeline_->fence();
}

// What the pipeline reads for `s`, in `dtype`. The live source when the
// optimizer is its only writer (guarded by fence()); a synchronous host
// snapshot when it changes in forward() (buffers: small, and the forward
// pass may start as soon as update() returns) or needs a conversion.
at::Tensor Averager::pipelineSource(Slot& s, at::ScalarType dtype) {
  at::Tensor live = s.tracked.source.detach();
  if (!s.tracked.changesInForward) {
    // Strided or converted sources become a private copy here, which the
    // caller may then overwrite freely.
    if (!live.is_contiguous()) live = live.contiguous();
    return live.scalar_type() == dtype ? live : live.to(dtype);
  }
  if (!s.snapshot.defined() || s.snapshot.scalar_type() != dtype ||
      s.snapshot.sizes() != live.sizes()) {
    s.snapshot = arena_->allocate(live.sizes(), dtype);
  }
  s.snapshot.copy_(live);  // blocks until read, on any device
  return s.snapshot;
}

// The comparison placement: ATen on the sources' device. ema + w * (x - ema)
// in float32 with the three roundings of the CPU kernels (sub, mul, add), so
// on CPU tensors it matches kPinnedHost bit for bit.
void Averager::updateOnDevice(bool firstCopy, const std::vector<double>& weights) {
  const bool weightIsOne = allWeightsOne(weights);
  for (const Slot& s : slots_) {
    if (isAveragingRole(s.tracked.role)) sourceTypeOf(s.tracked.source, s.tracked.name);
    TORCH_CHECK_VALUE(
        s.tracked.source.device() == s.ema.device() && s.tracked.source.sizes() == s.ema.sizes(),
        "Averager::update: tensor '", s.tracked.name, "' is now ", s.tracked.source.sizes(), " on ",
        s.tracked.source.device(), " but its EMA is ", s.ema.sizes(), " on ", s.ema.device(),
        " (placement kDevice keeps the EMA where the source was)");
  }
  c10::NoGradGuard noGrad;
  for (Slot& s : slots_) {
    const Action action = actionFor(s.tracked, firstCopy, weightIsOne);
    if (action == Action::kSkip) continue;
    for (size_t p = 0; p < weights.size(); ++p) {
      if (p > 0 && s.moreEmas.empty()) break;  // copies are shared
      const at::Tensor& ema = p == 0 ? s.ema : s.moreEmas[p - 1];
      if (action == Action::kCopy) {
        ema.copy_(s.tracked.source.detach());
        continue;
      }
      const double w = static_cast<float>(weights[p]);
      at::Tensor x = s.tracked.source.detach().to(at::kFloat);
      ema.add_(x.sub(ema).mul_(w));
    }
  }
}

void Averager::checkProfile(int profile, const char* api) const {
  TORCH_CHECK_INDEX(profile >= 0 && profile < numProfiles(), "Averager::", api, ": profile ",
                    profile, " does not exist (this Averager has ", numProfiles(), ")");
}

const at::Tensor& Averager::profileStorage(const Slot& s, int profile) const {
  return profile == 0 || s.moreEmas.empty() ? s.ema : s.moreEmas[profile - 1];
}

const DecaySchedule& Averager::profileSchedule(int profile) const {
  checkProfile(profile, "profileSchedule");
  return profile == 0 ? options_.schedule : options_.moreSchedules[profile - 1];
}

double Averager::profileLastDecay(int profile) const {
  checkProfile(profile, "profileLastDecay");
  return profile == 0 ? lastDecay_ : moreLastDecays_[profile - 1];
}

const at::Tensor& Averager::profileEma(int profile, const std::string& name) const {
  checkProfile(profile, "profileEma");
  const Slot& s = slot(name, "profileEma");
  settle("profileEma");
  return profileStorage(s, profile);
}

std::vector<std::pair<std::string, at::Tensor>> Averager::profileTensors(int profile) const {
  checkProfile(profile, "profileTensors");
  settle("profileTensors");
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(slots_.size());
  for (const Slot& s : slots_) out.emplace_back(s.tracked.name, profileStorage(s, profile));
  return out;
}

void Averager::restoreProgress(int64_t step, bool initialized) {
  TORCH_CHECK_VALUE(step >= 0, "Averager::restoreProgress: step (", step, ") must be >= 0");
  settle("restoreProgress");
  step_ = step;
  initialized_ = initialized;
}

const Averager::Slot& Averager::slot(const std::string& name, const char* api) const {
  const auto it = index_.find(name);
  TORCH_CHECK_INDEX(it != index_.end(), "Averager::", api, ": tensor '", name, "' is not tracked");
  return slots_[it->second];
}

std::vector<std::string> Averager::names() const {
  std::vector<std::string> out;
  out.reserve(slots_.size());
  for (const Slot& s : slots_) out.push_back(s.tracked.name);
  return out;
}

TrackRole Averager::role(const std::string& name) const { return slot(name, "role").tracked.role; }

const at::Tensor& Averager::ema(const std::string& name) const {
  const Slot& s = slot(name, "ema");
  settle("ema");
  return s.ema;
}

std::vector<std::pair<std::string, at::Tensor>> Averager::emaTensors() const {
  settle("emaTensors");
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(slots_.size());
  for (const Slot& s : slots_) out.emplace_back(s.tracked.name, s.ema);
  return out;
}

std::vector<TrackedTensor> Averager::tracked() const {
  std::vector<TrackedTensor> out;
  out.reserve(slots_.size());
  for (const Slot& s : slots_) out.push_back(s.tracked);
  return out;
}

void Averager::copyEmaToSources() {
  settle("copyEmaToSources");
  // Writing into leaf parameters is only allowed outside autograd.
  c10::NoGradGuard noGrad;
  if (!pipeline_) {
    for (Slot& s : slots_) s.tracked.source.detach().copy_(s.ema);
    return;
  }
  std::vector<offload::SwapJob> jobs;
  jobs.reserve(slots_.size());
  for (Slot& s : slots_) jobs.push_back({s.ema, s.tracked.source.detach(), s.tracked.name});
  pipeline_->copyToDestinations(jobs);
}

}  // namespace shardema
