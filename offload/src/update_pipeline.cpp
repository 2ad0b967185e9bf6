// One file over the 400-line guideline on purpose: submit, the copy
// callbacks, the workers' math (direct and staged), fence and wait share one
// mutex-guarded state machine (slotChunk_, claimed_/queued_/finished_,
// directClaimed_/directDone_, released_), and keeping every transition of it
// in one place is what makes its ordering reviewable (and what
// ThreadSanitizer runs exercise). The checks of a job and the jobs handed
// back (takeJobs) live in update_pipeline_jobs.cpp, how an update is cut
// into chunks in update_pipeline_plan.cpp, the swap-in copies (which do
// not touch that state) in update_pipeline_swap.cpp.
#include "shardema/offload/update_pipeline.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "error_text.h"
#include "shardema/core/failpoint.h"
#include "shardema/core/tensor_update.h"
#include "shardema/core/warning.h"
#include "shardema/offload/parallel_update.h"
#include "shardema/offload/pinned_arena.h"
#include "shardema/offload/worker_pool.h"

namespace shardema::offload {

namespace {

// The smallest chunkBytes: one cache line, the alignment of staged pieces.
constexpr int64_t kMinChunkBytes = 64;

std::string describe(std::exception_ptr error) { return detail::describeError(error); }

}  // namespace

UpdatePipeline::UpdatePipeline(UpdatePipelineOptions options) : options_(std::move(options)) {
  const char* api = "UpdatePipeline";
  TORCH_CHECK_VALUE(options_.chunkBytes >= kMinChunkBytes, api,
                    ": chunkBytes must be >= ", kMinChunkBytes, ", got ", options_.chunkBytes);
  TORCH_CHECK_VALUE(options_.numSlots >= 1, api, ": numSlots must be >= 1, got ",
                    options_.numSlots);
  TORCH_CHECK_VALUE(options_.engine != nullptr, api, ": options.engine is required");
  pool_ = options_.pool != nullptr ? options_.pool : &WorkerPool::shared();
  TORCH_CHECK_VALUE(pool_->size() >= 1, api,
                    ": the worker pool needs at least one thread, got 0 (the math must not run "
                    "on the copy engine's thread)");
  // The slots themselves come when a staged chunk first needs one
  // (reserveSlot): a model in host memory never stages, and a small one
  // needs far less than numSlots x chunkBytes.
  staging_.resize(options_.numSlots);
  stagingData_.assign(options_.numSlots, nullptr);
  slotBytes_.assign(options_.numSlots, 0);
  slotChunk_.assign(options_.numSlots, -1);
  slotCopyError_.assign(options_.numSlots, std::string());
  slotPartError_.assign(options_.numSlots, std::string());
  piecesLeft_ = std::make_unique<std::atomic<int>[]>(options_.numSlots);
  partsLeft_ = std::make_unique<std::atomic<int>[]>(options_.numSlots);
  // A CUDA copy's completion says nothing about when the host thread bumped
  // a version (it runs ahead of the device); host-side engines copy on the
  // CPU's timeline, so a version read after landing is meaningful.
  checkOnLanding_ = options_.engine->copiesOnHostTimeline();
}

void UpdatePipeline::reserveSlot(int slot, int64_t bytes) {
  if (slotBytes_[slot] >= bytes) return;
  const int64_t size = std::min(options_.chunkBytes, (bytes + kStagingGranularity - 1) /
                                                         kStagingGranularity * kStagingGranularity);
  // The old slot (if any) goes first: the pipeline never holds more than
  // numSlots x chunkBytes, not even while growing.
  staging_[slot] = at::Tensor();
  stagingData_[slot] = nullptr;
  const int64_t before = std::exchange(slotBytes_[slot], 0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.stagingBytes -= before;
  }
  staging_[slot] = options_.arena != nullptr ? options_.arena->allocate({size}, at::kByte)
                                             : at::empty({size}, at::kByte);
  stagingData_[slot] = static_cast<char*>(staging_[slot].data_ptr());
  slotBytes_[slot] = size;
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.stagingBytes += size;
}

UpdatePipeline::~UpdatePipeline() {
  try {
    wait();
  } catch (const c10::Error& e) {
    shardema::detail::warn(
        std::string("UpdatePipeline: an update failed and nobody waited for it: ") +
        e.what_without_backtrace());
  }
  // Completion callbacks may still be returning on the engine's thread.
  options_.engine->synchronize();
}

void UpdatePipeline::submit(std::vector<PipelineJob> jobs, std::vector<float> weights,
                            int64_t step) {
  {
    // The owner waits once, before submitting (the Averager's settle());
    // waiting here again would hide a forgotten wait() and report the last
    // update's error from a call about the next one.
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!inFlight_ && released_ && !firstError_, "UpdatePipeline::submit: the update of ",
                "step ", step_, " has not been waited for; call wait() before submitting step ",
                step);
  }
  TORCH_CHECK_VALUE(!weights.empty() && weights.size() <= static_cast<size_t>(kMaxProfiles),
                    "UpdatePipeline::submit: ", weights.size(), " weights given; 1 to ",
                    kMaxProfiles, " profiles are supported");
  for (float weight : weights) {
    TORCH_CHECK_VALUE(weight >= 0.0f && weight <= 1.0f,
                      "UpdatePipeline::submit: weight (1 - decay) must be in [0, 1], got ", weight);
  }
  // A job list of another length: the checks of indices past it go (and
  // the EMAs they held).
  checkedEmas_.resize(jobs.size());
  types_.clear();
  types_.reserve(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) types_.push_back(checkJob(jobs[j], j, weights.size()));
  jobs_ = std::move(jobs);
  plan(jobs_, types_);
  weights_ = std::move(weights);
  step_ = step;
  recordVersions();
  const auto total = static_cast<int64_t>(chunks_.size());
  if (total == 0) return;
  const int64_t staged = total - directChunks_;
  const int64_t first = std::min<int64_t>(options_.numSlots, staged);
  // Staged pieces follow the direct ones.
  const size_t firstStaged = staged > 0 ? chunks_[directChunks_].begin : pieces_.size();
  int64_t sourceBytes = 0, stagedBytes = 0;
  for (size_t p = 0; p < pieces_.size(); ++p) {
    sourceBytes += pieces_[p].bytes;
    if (p >= firstStaged) stagedBytes += pieces_[p].bytes;
  }
  // Direct chunks first: their reads are what fence() waits for. Each
  // drainer gets its first chunk here (see runDirectChunks).
  const int64_t drainers = std::min<int64_t>(directChunks_, pool_->size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    claimed_ = first;
    queued_ = finished_ = 0;
    directClaimed_ = drainers;
    directDone_ = 0;
    failed_ = false;
    inFlight_ = true;
    for (int64_t c = 0; c < first; ++c) slotChunk_[c] = directChunks_ + c;
    stats_.updates += 1;
    stats_.chunks += total;
    stats_.sourceBytes += sourceBytes;
    stats_.stagedBytes += stagedBytes;
  }
  for (int64_t d = 0; d < drainers; ++d) {
    pool_->post([this, d] { runDirectChunks(d, /*onWaiter=*/false); });
  }
  if (staged == 0) return;  // nothing for the engine
  options_.engine->recordProducerPoint();
  for (int64_t c = 0; c < first; ++c) issueChunk(directChunks_ + c, static_cast<int>(c));
}

// Runs on the submitting thread (first numSlots chunks) or on the worker
// that just freed `slot`. Never with mutex_ held: the engine may take its
// own lock, and its thread takes ours in onPieceLanded.
void UpdatePipeline::issueChunk(int64_t chunk, int slot) {
  const Chunk& c = chunks_[chunk];
  const auto pieces = static_cast<int>(c.end - c.begin);
  piecesLeft_[slot].store(pieces, std::memory_order_relaxed);
  for (int p = 0; p < pieces; ++p) {
    const Piece& piece = pieces_[c.begin + p];
    try {
      // The slot's first chunk of this update (submit()'s thread: see
      // reserveSlot) allocates or grows it to what every staged chunk of
      // the update needs; a refill finds it large enough. A failed
      // allocation fails the chunk like a failed copy.
      if (p == 0) reserveSlot(slot, stagedSlotBytes_);
      options_.engine->copyToHost(piece.src, stagingData_[slot] + piece.stagingOffset,
                                  static_cast<size_t>(piece.bytes),
                                  [this, slot](std::exception_ptr e) { onPieceLanded(slot, e); });
    } catch (...) {
      // The pieces the engine did not take will never call back: account
      // for them here so the chunk still finishes (as failed).
      const std::exception_ptr error = std::current_exception();
      for (int rest = p; rest < pieces; ++rest) onPieceLanded(slot, error);
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  ++queued_;
  if (allDone()) inFlight_ = false;
  changed_.notify_all();
}

// Engine thread: short, no engine calls. The last piece of a chunk hands
// the chunk to a worker.
void UpdatePipeline::onPieceLanded(int slot, std::exception_ptr error) {
  if (error) {
    // Only the message crosses threads: sharing the engine's exception
    // object would let its last release race a reader on another thread.
    const std::string message = describe(error);
    std::lock_guard<std::mutex> lock(mutex_);
    if (slotCopyError_[slot].empty()) slotCopyError_[slot] = "copy failed: " + message;
  }
  // acq_rel: the worker must see every piece's bytes, whichever callback
  // (or issuing thread) counted down last.
  if (piecesLeft_[slot].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // The chunk's math in flat parts, one task each: the pipeline owns the
    // threads, so it spreads a landed chunk over the workers the other
    // slots leave idle instead of a kernel reaching for them from inside a
    // worker.
    const int64_t chunk = chunkInSlot(slot);
    const int parts = partsOf(chunk);
    partsLeft_[slot].store(parts, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.stagedParts += parts;
    }
    for (int part = 0; part < parts; ++part) {
      pool_->post([this, slot, chunk, part, parts] { runChunkPart(slot, chunk, part, parts); });
    }
  }
}

int64_t UpdatePipeline::chunkInSlot(int slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slotChunk_[slot];
}

// A staged chunk is cut into as many parts as there are workers per slot
// (the others run other slots' chunks), none smaller than kDefaultMinGrain
// elements: one part on a small pool, where every worker is busy anyway.
int UpdatePipeline::partsOf(int64_t chunk) const {
  int64_t elements = 0;
  for (size_t p = chunks_[chunk].begin; p < chunks_[chunk].end; ++p) {
    if (jobs_[pieces_[p].job].op != UpdateOp::kCopyRaw) elements += pieces_[p].count;
  }
  const int64_t perSlot = std::max<int64_t>(1, pool_->size() / options_.numSlots);
  return static_cast<int>(std::clamp<int64_t>(elements / kDefaultMinGrain, 1, perSlot));
}

// Worker: the math of part `part` of `parts` of a landed chunk (or its
// failure); the last part to finish ends the chunk and queues the slot's
// next one.
void UpdatePipeline::runChunkPart(int slot, int64_t chunk, int part, int parts) {
  std::string failure;
  bool skip = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure = slotCopyError_[slot];
    skip = failed_;
    // The landing check: the chunk's bytes have landed; a source written
    // before now and before fence() may have been read torn. Under mutex_
    // so that it never runs after fence() released the sources; the first
    // part of the chunk is enough.
    if (part == 0 && checkOnLanding_) markWrittenSources(chunk);
  }
  if (failure.empty() && !skip) {
    try {
      applyChunk(chunk, stagingData_[slot], part, parts);
    } catch (...) {
      failure = describe(std::current_exception());
    }
  }
  if (!failure.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (slotPartError_[slot].empty()) slotPartError_[slot] = failure;
  }
  // acq_rel: the last part sees the others' EMA writes and failures.
  if (partsLeft_[slot].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slotCopyError_[slot].clear();
    failure = std::exchange(slotPartError_[slot], std::string());
  }
  finishChunk(slot, failure.empty() ? nullptr : chunkError(chunk, failure));
}

// Worker (or the thread in fence()/wait(), see helpWithDirectChunks):
// direct chunks, starting with `chunk` (claimed for this thread by submit()
// or by the helper), then the next unclaimed one, in order, each read in
// place.
// The chunk checks run before the math (a source already written: its new
// values are read) and after it (written while read: the EMA may hold a mix
// of old and new values), the second in the same critical section that
// counts the chunk done, so fence() cannot release the sources in between.
// The next chunk is claimed in that section too: a drainer touches the
// shared state only while it holds an unfinished chunk, so once the last
// chunk is done nothing of this update reads what the next submit() writes.
void UpdatePipeline::runDirectChunks(int64_t chunk, bool onWaiter) {
  bool skip = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    skip = failed_;
    if (!skip) markWrittenSources(chunk);
  }
  for (;;) {
    std::string failure;
    if (!skip) {
      try {
        applyChunk(chunk, nullptr, 0, 1);
      } catch (...) {
        failure = describe(std::current_exception());
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!skip) markWrittenSources(chunk);
    if (!failure.empty() && !failed_) {
      failed_ = true;
      firstError_ = chunkError(chunk, failure);
    }
    ++directDone_;
    if (onWaiter) ++stats_.waiterChunks;
    const bool more = directClaimed_ < directChunks_;
    if (more) {
      chunk = directClaimed_++;
      skip = failed_;
      if (!skip) markWrittenSources(chunk);
    }
    if (allDone()) inFlight_ = false;
    changed_.notify_all();
    if (!more) return;
  }
}

// fence()/wait(): rather than sleep until the workers have done every
// direct chunk, the waiting thread takes the unclaimed ones itself. The
// thread is blocked either way; this way the wait ends sooner (on a 2-core
// machine the one worker and the waiter share the math) and a small update
// does not wait for a worker to wake up at all. Chunks a worker has
// claimed stay its own: the waiter then sleeps as before.
void UpdatePipeline::helpWithDirectChunks() {
  int64_t chunk = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!inFlight_ || directClaimed_ >= directChunks_) return;
    chunk = directClaimed_++;
  }
  runDirectChunks(chunk, /*onWaiter=*/true);
}

std::exception_ptr UpdatePipeline::chunkError(int64_t chunk, const std::string& failure) const {
  // Name every tensor the chunk touches (usually one).
  std::ostringstream where;
  for (size_t p = chunks_[chunk].begin; p < chunks_[chunk].end; ++p) {
    where << (where.tellp() > 0 ? "', '" : " on tensor '") << jobs_[pieces_[p].job].name;
  }
  where << "' (chunk " << chunk << " of " << chunks_.size() << "): " << failure;
  return updateError(where.str());
}

void UpdatePipeline::markWrittenSources(int64_t chunk) {
  if (released_) return;
  size_t lastJob = jobs_.size();  // pieces of one job are adjacent: check it once
  for (size_t p = chunks_[chunk].begin; p < chunks_[chunk].end; ++p) {
    if (pieces_[p].job == lastJob) continue;
    lastJob = pieces_[p].job;
    if (!writtenWhileRead_[lastJob] && movedSince(lastJob)) writtenWhileRead_[lastJob] = 1;
  }
}

bool UpdatePipeline::allDone() const {
  return directDone_ == directChunks_ && finished_ == claimed_ && queued_ == claimed_;
}

// Worker: the math of part `part` of `parts` of one chunk, on this thread
// (the kernels start no threads; the direct chunks are already one per
// thread, a staged chunk's parts one task each). One path for any number of
// profiles: with one, each span has one EMA and the kernels take their
// single-profile loops (update_kernels.h). Raw copies are part 0's.
void UpdatePipeline::applyChunk(int64_t chunk, const char* staging, int part, int parts) {
  TORCH_CHECK(!failpoint::fires("offload.pipeline.chunk", step_, chunk),
              "injected fault (failpoint offload.pipeline.chunk) in chunk ", chunk, " of step ",
              step_);
  const Chunk& c = chunks_[chunk];
  const bool copiesRaw = part == 0;
  if (weights_.size() == 1) {
    // One profile: flat spans, no per-piece allocation (what keeps a
    // thousand small tensors cheap; the kernels match the multi path's).
    std::vector<UpdateSpan> spans;
    spans.reserve(c.end - c.begin);
    for (size_t p = c.begin; p < c.end; ++p) {
      const Piece& piece = pieces_[p];
      const char* src = staging != nullptr ? staging + piece.stagingOffset : piece.src;
      const PipelineJob& job = jobs_[piece.job];
      if (job.op == UpdateOp::kCopyRaw) {
        if (copiesRaw && piece.bytes > 0) {
          std::memcpy(piece.ema, src, static_cast<size_t>(piece.bytes));
        }
        continue;
      }
      spans.push_back(
          UpdateSpan{reinterpret_cast<float*>(piece.ema), src, piece.type, piece.count, job.op});
    }
    if (spans.empty()) return;
    const int64_t total = totalElements(spans);
    updateSpans(spans, weights_[0], pieceBegin(part, parts, total),
                pieceBegin(part + 1, parts, total));
    return;
  }
  std::vector<MultiUpdateSpan> spans;
  for (size_t p = c.begin; p < c.end; ++p) {
    const Piece& piece = pieces_[p];
    const PipelineJob& job = jobs_[piece.job];
    const char* staged = staging != nullptr ? staging + piece.stagingOffset : piece.src;
    if (job.op == UpdateOp::kCopyRaw) {
      if (copiesRaw && piece.bytes > 0) {
        std::memcpy(piece.ema, staged, static_cast<size_t>(piece.bytes));
      }
      continue;
    }
    // Every profile's piece sits at the same element offset as the first's.
    const auto first = static_cast<float*>(job.ema.data_ptr());
    const int64_t offset = reinterpret_cast<float*>(piece.ema) - first;
    MultiUpdateSpan span;
    span.emas.reserve(job.moreEmas.size() + 1);
    span.emas.push_back(reinterpret_cast<float*>(piece.ema));
    for (const at::Tensor& more : job.moreEmas) {
      span.emas.push_back(static_cast<float*>(more.data_ptr()) + offset);
    }
    span.src = staged;
    span.type = piece.type;
    span.count = piece.count;
    span.op = job.op;
    spans.push_back(std::move(span));
  }
  if (spans.empty()) return;
  const int64_t total = totalElements(spans);
  updateSpansMulti(spans, weights_, pieceBegin(part, parts, total),
                   pieceBegin(part + 1, parts, total));
}

void UpdatePipeline::finishChunk(int slot, std::exception_ptr&& error) {
  int64_t next = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Moved, not copied: this thread must hold no reference once the waiter
    // can see the error, or its release could be the one that frees it
    // (racing the waiter's reads, as ThreadSanitizer reports).
    if (error && !failed_) {
      failed_ = true;
      firstError_ = std::move(error);
    }
    error = nullptr;
    ++finished_;
    const auto staged = static_cast<int64_t>(chunks_.size()) - directChunks_;
    if (!failed_ && claimed_ < staged) next = directChunks_ + claimed_++;
    slotChunk_[slot] = next;
    // After a failure nothing new is claimed: the update ends once the
    // chunks already given to the engine are back.
    if (allDone()) inFlight_ = false;
    changed_.notify_all();
  }
  if (next >= 0) issueChunk(next, slot);
}

void UpdatePipeline::fence() {
  const auto start = std::chrono::steady_clock::now();
  helpWithDirectChunks();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] {
      const auto staged = static_cast<int64_t>(chunks_.size()) - directChunks_;
      return !inFlight_ || (directDone_ == directChunks_ && queued_ == claimed_ &&
                            (claimed_ == staged || failed_));
    });
  }
  // chunks_ is this thread's own (submit wrote it): no lock needed.
  if (static_cast<int64_t>(chunks_.size()) > directChunks_) options_.engine->fenceProducer();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard<std::mutex> lock(mutex_);
  releaseSources();
  stats_.lastFenceWaitSeconds = waited;
  stats_.fenceWaitSeconds += waited;
}

void UpdatePipeline::wait() {
  helpWithDirectChunks();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return !inFlight_; });
    releaseSources();
    error = std::exchange(firstError_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

void UpdatePipeline::recordVersions() {
  versions_.resize(jobs_.size());
  versionSources_.resize(jobs_.size());
  for (size_t j = 0; j < jobs_.size(); ++j) {
    // A copy of the counter handle, taken here on the caller's thread, so
    // workers never touch the TensorImpl; the count itself is atomic. The
    // same tensor as last update at this index keeps its handle: copying it
    // costs an atomic increment and a decrement of a refcount that shares
    // its cache line with the count the workers read, a cross-core miss per
    // tensor (a fifth of a 1000-tensor update's fixed cost).
    // versionSources_ holds the tensor whose counter that is, so an equal
    // TensorImpl address is the same tensor, whose counter is its own for
    // life. A job naming another tensor's counter (a DTensor's) hands it
    // over each time: the pipeline cannot tell whether it is the same one.
    auto& [counter, recorded] = versions_[j];
    if (jobs_[j].version.has_value()) {
      counter = *jobs_[j].version;
      versionSources_[j] = at::Tensor();
    } else {
      c10::TensorImpl* impl = jobs_[j].source.unsafeGetTensorImpl();
      if (versionSources_[j].unsafeGetTensorImpl() != impl) {
        versionSources_[j] = jobs_[j].source;
        counter = impl->version_counter();
      }
    }
    recorded = counter.enabled() ? counter.current_version() : 0;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  released_ = jobs_.empty();
  failed_ = false;  // a failed earlier update is done (submit waited)
  writtenWhileRead_.assign(jobs_.size(), 0);
}

bool UpdatePipeline::movedSince(size_t job) const {
  const auto& [counter, recorded] = versions_[job];
  return counter.enabled() && counter.current_version() != recorded;
}

std::vector<size_t> UpdatePipeline::writtenWhileRead() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<size_t> out;
  for (size_t j = 0; j < writtenWhileRead_.size(); ++j) {
    if (writtenWhileRead_[j]) out.push_back(j);
  }
  return out;
}

std::vector<size_t> UpdatePipeline::uncheckedReads() const {
  // inPlace_ is written by submit(), on this same thread (one entry per
  // job, also after takeJobs()).
  std::vector<size_t> out;
  if (checkOnLanding_) return out;
  for (size_t j = 0; j < inPlace_.size(); ++j) {
    if (!inPlace_[j]) out.push_back(j);
  }
  return out;
}

std::vector<size_t> UpdatePipeline::writtenSinceSubmit() const {
  // versions_ is written by submit(), on this same thread: no lock needed.
  std::vector<size_t> out;
  for (size_t j = 0; j < versions_.size(); ++j) {
    if (movedSince(j)) out.push_back(j);
  }
  return out;
}

std::exception_ptr UpdatePipeline::updateError(const std::string& what) const {
  return detail::capturedError("UpdatePipeline", c10::str("UpdatePipeline: the EMA update of step ",
                                                          step_, " failed", what));
}

bool UpdatePipeline::sourcesReleased() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return released_;
}

bool UpdatePipeline::busy() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return inFlight_;
}

PipelineStats UpdatePipeline::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace shardema::offload
