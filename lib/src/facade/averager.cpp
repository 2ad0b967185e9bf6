#include "shardema/averager.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <unordered_set>

#include "shardema/tensor_update.h"
#include "shardema/worker_pool.h"

namespace shardema {
namespace {

// The update kernels read host memory; sources on another device (or laid
// out strided) are brought over first. Contiguous CPU sources are read in
// place, which is the common case and costs nothing.
at::Tensor hostView(const at::Tensor& source) {
  at::Tensor host = source.detach();
  if (!host.device().is_cpu()) host = host.to(at::kCPU);
  return host.is_contiguous() ? host : host.contiguous();
}

at::Tensor makeStorage(const TrackedTensor& tracked) {
  const auto dtype = isAveragingRole(tracked.role) ? at::kFloat : tracked.source.scalar_type();
  at::Tensor storage = at::empty(tracked.source.sizes(), at::TensorOptions().dtype(dtype));
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

}  // namespace

Averager::Averager(std::vector<TrackedTensor> tensors, AveragerOptions options)
    : options_(std::move(options)) {
  std::unordered_set<std::string> seen;
  for (const TrackedTensor& tracked : tensors) checkTracked(tracked, seen);
  slots_.reserve(tensors.size());
  for (TrackedTensor& tracked : tensors) {
    at::Tensor storage = makeStorage(tracked);
    index_.emplace(tracked.name, slots_.size());
    slots_.push_back(Slot{std::move(tracked), std::move(storage)});
  }
  initialized_ = !options_.copyOnFirstUpdate;
}

Averager::Averager(Averager&&) noexcept = default;
Averager& Averager::operator=(Averager&&) noexcept = default;
Averager::~Averager() = default;

bool Averager::update(int64_t step) {
  TORCH_CHECK_VALUE(step > step_, "Averager::update: step must increase; got step ", step,
                    " after step ", step_);
  if (!options_.schedule.isDueAt(step)) {
    step_ = step;
    return false;
  }
  const double decay = options_.schedule.decayAt(step);
  if (!initialized_) {
    copyAll(/*includeCopyOnce=*/false);
    initialized_ = true;
  } else {
    lerpAveraged(1.0 - decay);
  }
  // Progress is recorded only once the update went through, so a failed
  // update can be retried at the same step.
  step_ = step;
  lastDecay_ = decay;
  return true;
}

void Averager::copyAll(bool includeCopyOnce) {
  for (Slot& s : slots_) {
    if (s.tracked.role == TrackRole::kCopyOnce && !includeCopyOnce) continue;
    s.ema.copy_(hostView(s.tracked.source));
  }
}

void Averager::lerpAveraged(double weight) {
  // A zero decay must reproduce the source exactly; ema + 1 * (x - ema) can
  // be off by an ulp, so it becomes a copy.
  const UpdateOp lerp = weight == 1.0 ? UpdateOp::kCopy : UpdateOp::kLerp;
  std::vector<TensorUpdate> updates;
  std::vector<Slot*> copies;
  updates.reserve(slots_.size());
  for (Slot& s : slots_) {
    const TrackRole role = s.tracked.role;
    if (isAveragingRole(role)) {
      const bool frozen =
          role == TrackRole::kAverageIfTrainable && !s.tracked.source.requires_grad();
      updates.push_back(TensorUpdate{s.ema, hostView(s.tracked.source),
                                     frozen ? UpdateOp::kCopy : lerp, s.tracked.name});
      checkTensorUpdate(updates.back());
    } else if (role == TrackRole::kCopy) {
      copies.push_back(&s);
    }
  }
  // Every averaged source was validated above, before anything is written:
  // a bad source (say, a model moved to float64) fails the whole update.
  WorkerPool* pool = options_.pool != nullptr ? options_.pool : &WorkerPool::shared();
  applyTensorUpdates(updates, weight, pool);
  for (Slot* s : copies) s->ema.copy_(hostView(s->tracked.source));
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

const at::Tensor& Averager::ema(const std::string& name) const { return slot(name, "ema").ema; }

std::vector<std::pair<std::string, at::Tensor>> Averager::emaTensors() const {
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
  // Writing into leaf parameters is only allowed outside autograd.
  c10::NoGradGuard noGrad;
  for (Slot& s : slots_) s.tracked.source.detach().copy_(s.ema);
}

}  // namespace shardema
