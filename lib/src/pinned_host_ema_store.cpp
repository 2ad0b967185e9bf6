#include "pinned_host_ema_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

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
      snapshots_(tracked.size()) {
  initStorage(tracked, static_cast<int>(options.moreSchedules.size()) + 1,
              [this](c10::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor&) {
                return arena_.allocate(sizes, dtype);
              });
}

void PinnedHostEmaStore::update(const EmaUpdate& update) {
  if (prefetchStale_) recordPrefetch();
  prefetch_.issue();
  // One pass over the bound sources: each is checked here against its EMA
  // (shape) and then by the pipeline's submit() (dtype, layout), once each,
  // before anything is folded in.
  std::vector<offload::PipelineJob> jobs;
  jobs.reserve(bound_.size());
  backgroundJobs_.clear();
  for (size_t i = 0; i < bound_.size(); ++i) {
    const UpdateOp op = update.ops[i];
    if (op == UpdateOp::kSkip) continue;
    const std::vector<at::Tensor>& profiles = storage_[i];
    offload::PipelineJob job{profiles.front(), at::Tensor(), op, bound_[i].name, {}, {}};
    if (op == UpdateOp::kCopyRaw) {
      // Copies keep their dtype; a source that changed dtype is converted
      // (rare: a module cast after the Averager was built).
      job.source = pipelineSource(i, job.ema.scalar_type());
    } else {
      job.moreEmas.assign(profiles.begin() + 1, profiles.end());
      job.source = pipelineSource(i, bound_[i].source.scalar_type());
    }
    // A snapshot (or a private converted copy) is the store's own: writes
    // to the live tensor after this point are not the update's concern.
    const bool live = job.source.unsafeGetTensorImpl() == bound_[i].source.unsafeGetTensorImpl();
    if (live) job.version = bound_[i].writeVersion;
    backgroundJobs_.push_back(live ? static_cast<int64_t>(i) : -1);
    jobs.push_back(std::move(job));
  }
  pipeline_.submit(std::move(jobs), update.weights, update.step);
  if (fenceInUpdate_) pipeline_.fence();
}

// The live source when the optimizer is its only writer (guarded by
// fence()); a synchronous host snapshot when it changes in forward()
// (buffers: small, and the forward pass may start as soon as update()
// returns) or needs a conversion.
at::Tensor PinnedHostEmaStore::pipelineSource(size_t index, at::ScalarType dtype) {
  const TrackedTensor& t = bound_[index];
  TORCH_CHECK_VALUE(t.source.sizes() == storage_[index].front().sizes(),
                    "Averager::update: tensor '", t.name, "' has shape ", t.source.sizes(),
                    " but the EMA has shape ", storage_[index].front().sizes());
  if (!t.changesInForward) {
    // The common case hands the pipeline the source itself: it only reads
    // its bytes and version counter, so no detached alias is needed (one
    // TensorImpl allocation per tensor per update saved).
    if (t.source.is_contiguous() && t.source.scalar_type() == dtype) return t.source;
    // Strided or converted sources become a private copy here, which the
    // caller may then overwrite freely (detached: no autograd graph).
    at::Tensor live = t.source.detach();
    if (!live.is_contiguous()) live = live.contiguous();
    return live.scalar_type() == dtype ? live : live.to(dtype);
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
