// Averager: names, roles, progress and the failure mark; the EMA storage
// and the update mechanics are its store's (ema_store.h), one per storage.
// Over the 400-line guideline: update(), its write judgement (judgeWrites)
// and the failure mark share the step/failed state; moving judgeWrites
// into its own file is the next split (left for a stop with a CI run).
#include "shardema/averager.h"

#include <ATen/ops/isfinite.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "averager_registry_entry.h"
#include "device_ema_store.h"
#include "ema_store.h"
#include "pinned_host_ema_store.h"
#include "shardema/core/tensor_file.h"
#include "shardema/core/tensor_update.h"
#include "shardema/core/update_kernels.h"
#include "shardema/core/warning.h"
#include "shardema/weight_swap.h"

namespace shardema {
namespace {

// Refused before any storage exists: a source whose values cannot be read
// (a meta tensor has a shape but no data; sparse and other non-strided
// layouts have no dense storage to copy from) would otherwise fail deep in
// the first copy, with an error that names no tensor.
void checkReadable(const TrackedTensor& tracked) {
  const at::Tensor& source = tracked.source;
  TORCH_CHECK_VALUE(!source.is_meta(), "Averager: tensor '", tracked.name,
                    "' is on the meta device: it has a shape but no values to start the EMA ",
                    "from; materialize the module (to_empty() and initialize it, or load its ",
                    "weights) before tracking it");
  TORCH_CHECK_VALUE(source.layout() == at::kStrided, "Averager: tensor '", tracked.name,
                    "' has layout ", source.layout(),
                    "; only dense (strided) tensors can be tracked (densify it with to_dense())");
  // A tensor subclass (a DTensor, a wrapper) may have no data of its own,
  // or data that is not its values: the engine reads bytes, so it tracks
  // the plain tensor inside (a DTensor's to_local()).
  TORCH_CHECK_VALUE(!source.key_set().has(c10::DispatchKey::Python), "Averager: tensor '",
                    tracked.name,
                    "' is a tensor subclass (Python dispatch, e.g. a DTensor); track the plain "
                    "tensor that holds its values (a DTensor's to_local())");
  TORCH_CHECK_VALUE(source.has_storage(), "Averager: tensor '", tracked.name,
                    "' has no storage to read its values from (a ", source.toString(),
                    "); track a dense tensor");
}

void checkTracked(const TrackedTensor& tracked, std::unordered_set<std::string>& seen) {
  TORCH_CHECK_VALUE(!tracked.name.empty(), "Averager: a tracked tensor has an empty name");
  TORCH_CHECK_VALUE(seen.insert(tracked.name).second, "Averager: tensor '", tracked.name,
                    "' is tracked twice; names must be unique");
  // State files store profile p > 0 under this prefix (profileTensorName).
  TORCH_CHECK_VALUE(tracked.name.rfind("shardema.profile_", 0) != 0, "Averager: tensor '",
                    tracked.name,
                    "' begins with 'shardema.profile_', which state files keep for "
                    "the names of further profiles; rename it");
  TORCH_CHECK_VALUE(tracked.source.defined(), "Averager: tensor '", tracked.name,
                    "' has an undefined source");
  checkReadable(tracked);
  if (isAveragingRole(tracked.role)) {
    const at::ScalarType dtype = tracked.source.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                     "Averager: tensor '", tracked.name, "' is ", c10::getDtypeNames(dtype).first,
                     "; the EMA averages float32, bfloat16 and float16 tensors (in float32): "
                     "convert the model first (to float32), or leave the tensor out of the EMA");
  } else {
    TORCH_CHECK_TYPE(tensorFilesCanHold(tracked.source.scalar_type()), "Averager: tensor '",
                     tracked.name, "' is tracked as a copy (role ", trackRoleName(tracked.role),
                     ") but has dtype ", tracked.source.scalar_type(),
                     ", which tensor files cannot hold, so its state could never be saved; copies "
                     "may be float64/32/16, bfloat16, int64/32/16/8, uint8 or bool");
  }
}

void checkSchedules(const AveragerOptions& options) {
  TORCH_CHECK_VALUE(options.moreSchedules.size() < static_cast<size_t>(kMaxProfiles),
                    "Averager: options.moreSchedules holds ", options.moreSchedules.size(),
                    " schedules; at most ", kMaxProfiles - 1, " profiles can be added");
  for (size_t p = 0; p < options.moreSchedules.size(); ++p) {
    TORCH_CHECK_VALUE(options.moreSchedules[p].updateEvery() == options.schedule.updateEvery(),
                      "Averager: options.moreSchedules[", p, "] updates every ",
                      options.moreSchedules[p].updateEvery(), " steps but options.schedule every ",
                      options.schedule.updateEvery(), "; profiles share their due steps");
  }
}

// What a due update does to one tensor: kCopyOnce tensors are left alone,
// copies are refreshed in their own dtype, averaged tensors lerp (or are set
// to their source on the first update, with a zero decay, or while frozen).
UpdateOp opFor(const TrackedTensor& tracked, bool firstCopy, bool weightIsOne) {
  if (tracked.role == TrackRole::kCopyOnce) return UpdateOp::kSkip;
  if (tracked.role == TrackRole::kCopy) return UpdateOp::kCopyRaw;
  if (firstCopy || weightIsOne) return UpdateOp::kCopy;
  const bool frozen =
      tracked.role == TrackRole::kAverageIfTrainable && !tracked.source.requires_grad();
  return frozen ? UpdateOp::kCopy : UpdateOp::kLerp;
}

// A zero decay must reproduce the source exactly; ema + 1 * (x - ema) can
// be off by an ulp, so it becomes a copy (when every profile has it).
bool allWeightsOne(const std::vector<double>& weights) {
  for (double w : weights) {
    if (w != 1.0) return false;
  }
  return true;
}

}  // namespace

Averager::Averager(std::vector<TrackedTensor> tensors, AveragerOptions options)
    : options_(std::move(options)) {
  std::unordered_set<std::string> seen;
  for (const TrackedTensor& tracked : tensors) checkTracked(tracked, seen);
  checkSchedules(options_);
  moreLastDecays_.assign(options_.moreSchedules.size(), 0.0);
  if (options_.storage == EmaStorage::kPinnedHost) {
    store_ = std::make_unique<detail::PinnedHostEmaStore>(tensors, options_);
  } else {
    store_ = std::make_unique<detail::DeviceEmaStore>(tensors, numProfiles());
  }
  tracked_ = std::move(tensors);
  for (size_t i = 0; i < tracked_.size(); ++i) index_.emplace(tracked_[i].name, i);
  initialized_ = !options_.copyOnFirstUpdate;
  detail::registerAverager(this);
}

Averager::Averager(Averager&& other) noexcept
    : options_(std::move(other.options_)),
      tracked_(std::move(other.tracked_)),
      index_(std::move(other.index_)),
      step_(other.step_),
      initialized_(other.initialized_),
      lastDecay_(other.lastDecay_),
      moreLastDecays_(std::move(other.moreLastDecays_)),
      failure_(std::move(other.failure_)),
      writesToJudge_(other.writesToJudge_),
      lastReadInsideUpdate_(other.lastReadInsideUpdate_),
      updatedOnce_(other.updatedOnce_),
      store_(std::move(other.store_)) {
  detail::registerAverager(this);
}

Averager& Averager::operator=(Averager&& other) noexcept {
  if (this == &other) return *this;
  // The old store retires its update in flight as the destructor would.
  store_ = std::move(other.store_);
  options_ = std::move(other.options_);
  tracked_ = std::move(other.tracked_);
  index_ = std::move(other.index_);
  step_ = other.step_;
  initialized_ = other.initialized_;
  lastDecay_ = other.lastDecay_;
  moreLastDecays_ = std::move(other.moreLastDecays_);
  failure_ = std::move(other.failure_);
  writesToJudge_ = other.writesToJudge_;
  lastReadInsideUpdate_ = other.lastReadInsideUpdate_;
  updatedOnce_ = other.updatedOnce_;
  return *this;
}

Averager::~Averager() {
  detail::unregisterAverager(this);
  // store_'s destructor then waits for the update in flight (members are
  // destroyed after this body), outside the registry: fenceEveryAverager()
  // no longer sees this one.
}

detail::EmaStore& Averager::store(const char* api) const {
  TORCH_CHECK(store_ != nullptr, "Averager::", api, ": this Averager was moved from");
  return *store_;
}

void Averager::checkNotFailed(const char* api) const {
  TORCH_CHECK(failure_.empty(), "Averager::", api, ": this Averager is failed since a background ",
              "update failed (", failure_, "); its EMA is partly updated. Restore a saved state ",
              "with loadState() or load() to continue");
}

void Averager::settle(const char* api) const {
  checkNotFailed(api);
  // A moved-from Averager holds no EMA: every call that reads or changes
  // one says so instead of quietly returning nothing.
  detail::EmaStore& emaStore = store(api);
  try {
    emaStore.wait();
  } catch (const c10::Error& e) {
    failure_ = e.what_without_backtrace();
    writesToJudge_ = false;  // a failed update's reads mean nothing
    TORCH_CHECK(false, "Averager::", api, ": ", failure_,
                ". The EMA is partly updated and this Averager is now failed: restore a saved "
                "state with loadState() or load() to continue");
  }
  judgeWrites();
  TORCH_CHECK(failure_.empty(), "Averager::", api, ": ", failure_,
              ". The EMA is partly updated and this Averager is now failed: restore a saved "
              "state with loadState() or load() to continue");
}

void Averager::fence() {
  // Like every other call, a fence on a failed Averager says so: the loop
  // must not go on training as if its EMA were kept.
  checkNotFailed("fence");
  store("fence").fence();
  // Never throws for a write: with kFenceRequired the failure it finds is
  // reported by the next call (wait(), update()).
  judgeWrites();
}

// Called once per due update, at the first call that fences or waits after
// it: the caller's thread is back, so whatever moved a source since
// update() ran on it, between update() and here. With fence() (the
// optimizer's pre-step point in Python) that is a write besides the
// optimizer's; with a later call it may be the optimizer's own, when
// nothing fenced.
void Averager::judgeWrites() const {
  if (!writesToJudge_) return;
  writesToJudge_ = false;
  const detail::EmaStore::Writes writes = store_->writes();
  if (writes.moved.empty() && writes.maybeOverlapped.empty()) return;
  if (options_.sourceWrites == SourceWrites::kFenceRequired) {
    const size_t first =
        writes.maybeOverlapped.empty() ? writes.moved.front() : writes.maybeOverlapped.front();
    failure_ = c10::str(
        "the EMA update of step ", step_, " failed: source tensor '", tracked_[first].name,
        "' was written in place while the update was reading it: it was modified before "
        "fence(): call Averager::fence() (EmaCallback::onBeforeOptimizerStep()) before "
        "optimizer.step()");
    return;
  }
  // kAdaptive: what was written is read inside update() from now on.
  std::vector<size_t> written = writes.moved;
  for (size_t index : writes.maybeOverlapped) {
    if (std::find(written.begin(), written.end(), index) == written.end()) {
      written.push_back(index);
    }
  }
  std::sort(written.begin(), written.end());
  if (options_.offload.fenceInUpdate) return;  // every read is inside update() already
  for (size_t index : written) store_->readInsideUpdate(index);
  const auto names = [this](const std::vector<size_t>& indices) {
    std::ostringstream out;
    for (size_t k = 0; k < indices.size() && k < 5; ++k) {
      out << (k > 0 ? ", '" : "'") << tracked_[indices[k]].name << "'";
    }
    if (indices.size() > 5) out << " and " << indices.size() - 5 << " more";
    return out.str();
  };
  std::ostringstream message;
  message << "Averager: " << names(written) << (written.size() > 1 ? " were" : " was")
          << " written in place after update(" << step_
          << ") returned and before the next fence() (the next optimizer step), while the "
             "update may have been reading "
          << (written.size() > 1 ? "them" : "it")
          << " in the background; from now on update() reads "
          << (written.size() > 1 ? "them" : "it")
          << " before it returns, so such a write cannot overlap the read (to keep the read "
             "in the background, call fence() before that write)";
  if (!lastReadInsideUpdate_ && !writes.maybeOverlapped.empty()) {
    message << ". The EMA of step " << step_ << " may mix the values of "
            << names(writes.maybeOverlapped)
            << " from before and after that write (by at most (1 - decay) times the change)";
  }
  shardema::detail::warn(message.str());
}

void Averager::wait() { settle("wait"); }

offload::PipelineStats Averager::offloadStats() const {
  return store_ ? store_->stats() : offload::PipelineStats{};
}

bool Averager::update(int64_t step) {
  detail::EmaStore& emaStore = store("update");
  TORCH_CHECK_VALUE(step >= 1, "Averager::update: steps are the 1-based optimizer steps; got step ",
                    step);
  TORCH_CHECK_VALUE(step > step_, "Averager::update: step must increase; got step ", step,
                    " after step ", step_);
  // Inside a swap the model holds EMA weights (this one's or another's):
  // averaging them as the model's would fold an EMA into itself.
  for (const TrackedTensor& t : tracked_) {
    const std::optional<std::string> owner = swappedInBy(t.source);
    TORCH_CHECK_VALUE(!owner, "Averager::update: tensor '", t.name, "' holds the EMA weights ",
                      *owner, " swapped in; update() after that swap ends (the model's ",
                      "weights are not in it until then)");
  }
  // Read before the wait below releases the sources.
  const bool fenced = emaStore.sourcesReleased();
  settle("update");  // the one wait; a written source seen by it is reported first
  if (!fenced && options_.sourceWrites == SourceWrites::kFenceRequired) rejectUnfenced(step);
  if (!options_.schedule.isDueAt(step)) {
    step_ = step;
    return false;
  }
  std::vector<double> decays;
  std::vector<double> weights;
  for (int p = 0; p < numProfiles(); ++p) {
    decays.push_back((p == 0 ? options_.schedule : options_.moreSchedules[p - 1]).decayAt(step));
    weights.push_back(1.0 - decays.back());
  }
  const bool firstCopy = !initialized_;
  const bool weightIsOne = allWeightsOne(weights);
  detail::EmaUpdate plan;
  plan.step = step;
  plan.weights.assign(weights.begin(), weights.end());
  plan.ops.reserve(tracked_.size());
  for (const TrackedTensor& t : tracked_) plan.ops.push_back(opFor(t, firstCopy, weightIsOne));
  if (options_.refuseNonFinite) checkFinite(plan, step);
  emaStore.update(plan);
  // kAdaptive reads the first due update's sources before returning: no
  // write the loop makes after it can overlap that read, and the next
  // judgeWrites() learns which sources the loop writes before fence().
  lastReadInsideUpdate_ = options_.offload.fenceInUpdate ||
                          (options_.sourceWrites == SourceWrites::kAdaptive && !updatedOnce_);
  if (lastReadInsideUpdate_) emaStore.fence();
  writesToJudge_ = true;
  updatedOnce_ = true;
  // Progress is recorded only once the update was accepted, so an update
  // refused on the caller can be retried at the same step.
  initialized_ = true;
  step_ = step;
  lastDecay_ = decays.front();
  moreLastDecays_.assign(decays.begin() + 1, decays.end());
  return true;
}

void Averager::checkFinite(const detail::EmaUpdate& plan, int64_t step) const {
  for (size_t i = 0; i < tracked_.size(); ++i) {
    const at::Tensor& source = tracked_[i].source;
    if (plan.ops[i] == UpdateOp::kSkip || !at::isFloatingType(source.scalar_type())) continue;
    TORCH_CHECK_VALUE(at::isfinite(source.detach()).all().item<bool>(),
                      "Averager::update: tensor '", tracked_[i].name, "' holds NaN or Inf at step ",
                      step, " (refuseNonFinite); the step was not taken and the EMA is unchanged");
  }
}

// The previous update was neither fenced nor waited for, so whatever ran
// since (the optimizer step) may have written its sources while they were
// read. The version check cannot prove otherwise: LibTorch's C++ optimizers
// write through tensor.data(), which has its own version counter. So this
// is an error, the EMA counts as torn, and the loop must be fixed.
void Averager::rejectUnfenced(int64_t step) {
  std::ostringstream why;
  why << "update(" << step << ") came without fence() or wait() since update(" << step_
      << "): its sources may have been modified before fence(): call Averager::fence() "
         "(EmaCallback::onBeforeOptimizerStep()) before optimizer.step()";
  failure_ = why.str();
  TORCH_CHECK(false, "Averager::update: ", failure_,
              ". This Averager is now failed: restore a saved state with loadState() or load() "
              "to continue");
}

void Averager::checkProfile(int profile, const char* api) const {
  TORCH_CHECK_INDEX(profile >= 0 && profile < numProfiles(), "Averager::", api, ": profile ",
                    profile, " does not exist (this Averager has ", numProfiles(), ")");
}

const DecaySchedule& Averager::schedule(int profile) const {
  checkProfile(profile, "schedule");
  return profile == 0 ? options_.schedule : options_.moreSchedules[profile - 1];
}

double Averager::lastDecay(int profile) const {
  checkProfile(profile, "lastDecay");
  return profile == 0 ? lastDecay_ : moreLastDecays_[profile - 1];
}

size_t Averager::indexOf(const std::string& name, const char* api) const {
  const auto it = index_.find(name);
  TORCH_CHECK_INDEX(it != index_.end(), "Averager::", api, ": tensor '", name, "' is not tracked");
  return it->second;
}

const at::Tensor& Averager::ema(const std::string& name, int profile) const {
  checkProfile(profile, "ema");
  const size_t index = indexOf(name, "ema");
  settle("ema");
  return store_->storage(index, profile);
}

std::vector<std::pair<std::string, at::Tensor>> Averager::emaTensors(int profile) const {
  checkProfile(profile, "emaTensors");
  settle("emaTensors");
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(tracked_.size());
  for (size_t i = 0; i < tracked_.size(); ++i) {
    out.emplace_back(tracked_[i].name, store_->storage(i, profile));
  }
  return out;
}

void Averager::rebindSource(const std::string& name, const at::Tensor& source, bool newWriter) {
  const size_t index = indexOf(name, "rebindSource");
  TrackedTensor replacement = tracked_[index];
  replacement.source = source;
  TORCH_CHECK_VALUE(source.defined(), "Averager::rebindSource: tensor '", name,
                    "' was replaced by an undefined tensor");
  checkReadable(replacement);
  const at::Tensor& old = tracked_[index].source;
  TORCH_CHECK_VALUE(source.scalar_type() == old.scalar_type() && source.sizes() == old.sizes() &&
                        source.device() == old.device(),
                    "Averager::rebindSource: tensor '", name, "' was replaced by a ",
                    source.scalar_type(), " tensor of shape ", source.sizes(), " on ",
                    source.device(), " but the EMA follows a ", old.scalar_type(),
                    " tensor of shape ", old.sizes(), " on ", old.device());
  // No wait: an update in flight reads its own handles of the old source.
  if (newWriter) replacement.writeVersion = std::nullopt;
  store("rebindSource").rebind(index, source, newWriter);
  tracked_[index] = std::move(replacement);
}

std::pair<c10::ScalarType, std::vector<int64_t>> Averager::emaDtypeAndShape(
    const std::string& name) const {
  const at::Tensor& storage =
      store("emaDtypeAndShape").storage(indexOf(name, "emaDtypeAndShape"), 0);
  return {storage.scalar_type(), storage.sizes().vec()};
}

void Averager::restoreProgress(int64_t step, bool initialized) {
  TORCH_CHECK_VALUE(step >= 0, "Averager::restoreProgress: step (", step, ") must be >= 0");
  settle("restoreProgress");
  step_ = step;
  initialized_ = initialized;
}

std::vector<std::string> Averager::readInsideUpdate() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < tracked_.size(); ++i) {
    if (store_ != nullptr && store_->readsInsideUpdate(i)) out.push_back(tracked_[i].name);
  }
  return out;
}

std::vector<std::string> Averager::names() const {
  std::vector<std::string> out;
  out.reserve(tracked_.size());
  for (const TrackedTensor& t : tracked_) out.push_back(t.name);
  return out;
}

TrackRole Averager::role(const std::string& name) const {
  return tracked_[indexOf(name, "role")].role;
}

std::vector<TrackedTensor> Averager::tracked() const { return tracked_; }

void Averager::copyTo(int profile) {
  checkProfile(profile, "copyTo");
  settle("copyTo");
  // Writing into leaf parameters is only allowed outside autograd.
  c10::NoGradGuard noGrad;
  store("copyTo").copyTo(profile);
}

}  // namespace shardema
