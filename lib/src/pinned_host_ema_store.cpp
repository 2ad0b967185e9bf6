#include "pinned_host_ema_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "shardema/core/prefetch.h"

namespace shardema::detail {
namespace {

offload::UpdatePipelineOptions pipelineOptions(const AveragerOptions& options,
                                               offload::CopyEngine* engine,
                                               offload::PinnedArena* arena) {
  offload::UpdatePipelineOptions pipeline;
  pipeline.chunkBytes = options.offload.chunkBytes;
  pipeline.numSlots = options.offload.numSlots;
  pipeline.pool = options.pool;
  pipeline.engine = engine;
  pipeline.arena = arena;
  return pipeline;
}

}  // namespace

PinnedHostEmaStore::PinnedHostEmaStore(const std::vector<TrackedTensor>& tracked,
                                       const AveragerOptions& options)
    : fenceInUpdate_(options.offload.fenceInUpdate),
      engine_(offload::makeCopyEngine(options.offload.engine)),
      pipeline_(pipelineOptions(options, engine_.get(), &arena_)),
      snapshots_(tracked.size()),
      converted_(tracked.size()) {
  initStorage(tracked, static_cast<int>(options.moreSchedules.size()) + 1,
              [this](c10::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor&) {
                return arena_.allocate(sizes, dtype);
              });
  emaShapes_.reserve(storage_.size());
  for (const std::vector<at::Tensor>& profiles : storage_) {
    emaShapes_.emplace_back(profiles.front().sizes().begin(), profiles.front().sizes().end());
  }
}

void PinnedHostEmaStore::update(const EmaUpdate& update) {
  if (prefetchStale_) recordPrefetch();
  prefetch_.issue();
  // The last update's jobs, changed where this one differs: an update of
  // the same tensors copies no EMA handle and no name, each a write or a
  // read of a cold line per tensor once a large model's math has run
  // through the caches (issue 32: update()'s return with 1000 tensors).
  std::vector<offload::PipelineJob> jobs = pipeline_.takeJobs();
  bool same = jobs.size() == jobTensors_.size();
  size_t taken = 0;  // jobs of this update so far
  for (size_t i = 0; same && i < bound_.size(); ++i) {
    if (update.ops[i] == UpdateOp::kSkip) continue;
    same = taken < jobTensors_.size() && jobTensors_[taken++] == i;
  }
  same = same && taken == jobTensors_.size();
  if (!same) {
    jobs.clear();
    jobTensors_.clear();
  }
  // One pass over the bound sources: each is checked here against its EMA
  // (shape) and then by the pipeline's submit() (dtype, layout), once each,
  // before anything is folded in.
  backgroundJobs_.clear();
  size_t k = 0;
  for (size_t i = 0; i < bound_.size(); ++i) {
    const UpdateOp op = update.ops[i];
    if (op == UpdateOp::kSkip) continue;
    if (!same) {
      jobs.push_back(newJob(i, op));
      jobTensors_.push_back(i);
    }
    offload::PipelineJob& job = jobs[k++];
    // Raw copies have no further EMAs; averaged ones one per profile.
    if ((job.op == UpdateOp::kCopyRaw) != (op == UpdateOp::kCopyRaw)) job = newJob(i, op);
    job.op = op;
    // Copies keep their dtype; a source that changed dtype is converted
    // (rare: a module cast after the Averager was built).
    const at::Tensor& source = pipelineSource(
        i, op == UpdateOp::kCopyRaw ? job.ema.scalar_type() : bound_[i].source.scalar_type());
    // Compared by address: the job holds its old source, so an equal one
    // is the same tensor (no handle copied, no refcount written).
    if (job.source.unsafeGetTensorImpl() != source.unsafeGetTensorImpl()) job.source = source;
    // A snapshot (or a private converted copy) is the store's own: writes
    // to the live tensor after this point are not the update's concern.
    const bool live = source.unsafeGetTensorImpl() == bound_[i].source.unsafeGetTensorImpl();
    if (!live || !bound_[i].writeVersion) {
      job.version.reset();
    } else if (!job.version || core::versionCounterAddress(*job.version) !=
                                   core::versionCounterAddress(*bound_[i].writeVersion)) {
      job.version = bound_[i].writeVersion;
    }
    backgroundJobs_.push_back(live ? static_cast<int64_t>(i) : -1);
  }
  pipeline_.submit(std::move(jobs), update.weights, update.step);
  if (fenceInUpdate_) pipeline_.fence();
}

offload::PipelineJob PinnedHostEmaStore::newJob(size_t index, UpdateOp op) const {
  const std::vector<at::Tensor>& profiles = storage_[index];
  offload::PipelineJob job{profiles.front(), at::Tensor(), op, bound_[index].name, {}, {}};
  if (op != UpdateOp::kCopyRaw) job.moreEmas.assign(profiles.begin() + 1, profiles.end());
  return job;
}

// The live source when the optimizer is its only writer (guarded by
// fence()); a synchronous host snapshot when it changes in forward()
// (buffers: small, and the forward pass may start as soon as update()
// returns) or needs a conversion.
const at::Tensor& PinnedHostEmaStore::pipelineSource(size_t index, at::ScalarType dtype) {
  const TrackedTensor& t = bound_[index];
  TORCH_CHECK_VALUE(t.source.sizes() == c10::IntArrayRef(emaShapes_[index]),
                    "Averager::update: tensor '", t.name, "' has shape ", t.source.sizes(),
                    " but the EMA has shape ", c10::IntArrayRef(emaShapes_[index]));
  if (!t.changesInForward) {
    // The common case hands the pipeline the source itself: it only reads
    // its bytes and version counter, so no detached alias is needed (one
    // TensorImpl allocation per tensor per update saved).
    if (t.source.is_contiguous() && t.source.scalar_type() == dtype) return t.source;
    // Strided or converted sources become a private copy here, which the
    // caller may then overwrite freely (detached: no autograd graph).
    at::Tensor live = t.source.detach();
    if (!live.is_contiguous()) live = live.contiguous();
    converted_[index] = live.scalar_type() == dtype ? live : live.to(dtype);
    return converted_[index];
  }
  const at::Tensor live = t.source.detach();
  at::Tensor& snapshot = snapshots_[index];
  if (!snapshot.defined() || snapshot.scalar_type() != dtype || snapshot.sizes() != live.sizes()) {
    snapshot = arena_.allocate(live.sizes(), dtype);
  }
  snapshot.copy_(live);  // blocks until read, on any device
  return snapshot;
}

EmaStore::Writes PinnedHostEmaStore::writes() const {
  Writes out;
  const auto tracked = [this](size_t job) { return backgroundJobs_[job]; };
  for (size_t job : pipeline_.writtenSinceSubmit()) {
    if (tracked(job) >= 0) out.moved.push_back(static_cast<size_t>(tracked(job)));
  }
  for (size_t job : pipeline_.writtenWhileRead()) {
    if (tracked(job) >= 0) out.maybeOverlapped.push_back(static_cast<size_t>(tracked(job)));
  }
  // Staged reads no chunk check could time (CUDA): a write since submit()
  // may have landed on the device during the copy.
  for (size_t job : pipeline_.uncheckedReads()) {
    if (tracked(job) < 0) continue;
    const auto index = static_cast<size_t>(tracked(job));
    if (std::find(out.moved.begin(), out.moved.end(), index) != out.moved.end() &&
        std::find(out.maybeOverlapped.begin(), out.maybeOverlapped.end(), index) ==
            out.maybeOverlapped.end()) {
      out.maybeOverlapped.push_back(index);
    }
  }
  std::sort(out.maybeOverlapped.begin(), out.maybeOverlapped.end());
  return out;
}

void PinnedHostEmaStore::copyTo(int profile) {
  std::vector<offload::SwapJob> jobs;
  jobs.reserve(bound_.size());
  for (size_t i = 0; i < bound_.size(); ++i) {
    jobs.push_back({storage(i, profile), bound_[i].source.detach(), bound_[i].name});
  }
  pipeline_.copyTo(jobs);
}

}  // namespace shardema::detail
