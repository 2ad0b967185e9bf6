#pragma once
// UpdatePipeline: one asynchronous, chunked EMA update at a time (DESIGN.md
// section 2). The sources' bytes are cut into chunks of at most chunkBytes,
// and each chunk takes one of two paths:
//   - Direct (sources in host memory: CPU training, or the host side of a
//     job with device sources): a worker folds the chunk into the EMA reading the
//     source in place. No staging, no copy engine: 12 bytes move per fp32
//     element (read source and EMA, write EMA), 10 per bf16/fp16 element.
//   - Staged (sources on a device, or every source with stageHostSources):
//     the copy engine copies chunk k into a free staging slot and, when it
//     has landed, the workers fold it into the host EMA, in as many parts
//     as there are workers per slot (one task each, PipelineStats::
//     stagedParts), and free the slot. The worker that finishes a slot's
//     last part is the one that queues the next chunk's copy into it, so neither the user's thread nor the engine's callback
//     ever waits for a slot: the copy of chunk k+1 overlaps the math of
//     chunk k. A host source staged this way moves 20 bytes per fp32
//     element (the copy reads 4 and writes 4 more), 14 per bf16 element.
// Direct chunks come first and their math starts at submit(), before the
// staged chunks' math competes for the workers, so their reads (which
// fence() waits for) finish early.
//
// Staging memory: allocated when first needed, never per update. The
// constructor allocates none. A slot is allocated (from the arena) when a
// staged chunk first needs it, on the submitting thread (submit() issues
// every slot's first chunk of an update; the workers' refills find it
// large enough), as large as the largest staged chunk of that update
// rounded up to kStagingGranularity, at most chunkBytes, and only as many
// slots as the update has staged chunks, at most numSlots. copyTo()
// allocates the same way for the conversions it stages (a dtype change
// into a device tensor; host destinations are converted in place). A slot
// is kept for the pipeline's life and replaced by a larger one only when
// a later update needs more (a model whose staged bytes grew). So a model
// in host memory holds no staging, a small one on a device one small slot,
// and one of more than numSlots chunks numSlots x chunkBytes, its most,
// all allocated at its first update (PipelineStats::stagingBytes).
//
// Threads: submit/fence/wait/copyTo are for one user thread
// (the training loop); the math runs on the WorkerPool, each chunk or part
// on one thread (the kernels start none, so no work nests in a worker), copy completions on
// the engine's thread. A thread blocked in fence() or wait() runs the direct
// chunks no worker has claimed yet instead of sleeping (counted in
// PipelineStats::waiterChunks). No user code runs on either. The engine's
// copyToHost is called from the submitting thread and from workers, several
// at once (one per slot being refilled); never while this thread is inside
// recordProducerPoint/fenceProducer/synchronize for the same update, and
// never from an engine callback. An update without staged chunks never
// calls the engine.
//
// Errors: a copy or math error fails the update: chunks not yet claimed are
// dropped (the EMA is then partly updated: callers must treat it as such,
// see Averager), the error is rethrown once by wait(), and the next submit
// starts afresh.
//
// Writes to the sources: a source written in place while the update may
// still read it would fold a mix of old and new values in, so submit()
// records each source's autograd version counter (bumped by every in-place
// op, optimizer.step() included; an atomic, safe to read from any thread;
// PipelineJob::version names another tensor's counter where writes go
// through that one, e.g. a DTensor's) and the pipeline reports what moved;
// it never fails an update for a write: what a write means (misuse to
// refuse, or a source to read differently from now on) is its owner's
// decision (the Averager's, averager.h). Two reports: (1) the chunk checks,
// on the worker after each staged chunk's copy has landed, with engines
// whose completion means the bytes were read on the CPU's timeline
// (CopyEngine::copiesOnHostTimeline(); not CUDA, whose host-side version
// bumps run ahead of the device), and before and after each direct chunk's
// math, mark a job whose source moved while its chunks were being read
// (writtenWhileRead()); they stop once fence() or wait() has released the
// sources (under mutex_, so a write the caller makes after fence() returns
// is never mistaken for one during the read; fence() waits for every direct
// chunk, so the checks always run before that); (2) writtenSinceSubmit()
// compares every counter now, on the caller's thread. A chunk whose source
// moved is read as it is (the new values where the write came first): the
// read is not redone. Writes through tensor.data() (a new version counter)
// are not seen, nor a host source written by an asynchronous device copy
// the caller has not synchronized (ATen's rule for any CPU read of it).
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shardema/core/update_kernels.h"
#include "shardema/offload/copy_engine.h"
#include "shardema/offload/pipeline_stats.h"

namespace shardema {

namespace offload {

class WorkerPool;

class PinnedArena;

/// Default UpdatePipelineOptions::chunkBytes and numSlots (and the
/// Averager's): 4 slots of 8 MiB, 32 MiB of staging, chosen from
/// offload_bench's staging sweep (docs/performance.md, "Staging defaults").
/// More slots let the copies run ahead of the math when their rates vary;
/// larger chunks cost fewer copy calls and hand-offs (a CUDA copy has a
/// fixed cost of some microseconds) and, on the direct path, fewer
/// per-chunk source checks, but more staging memory and a longer pipeline
/// fill (the first math waits for a whole chunk).
constexpr int64_t kDefaultChunkBytes = int64_t{8} << 20;
constexpr int kDefaultNumSlots = 4;
/// Staging slots smaller than chunkBytes are allocated in multiples of this
/// (a page: the arena hands out whole pages anyway), so a model whose
/// staged bytes change by a few bytes does not reallocate.
constexpr int64_t kStagingGranularity = 4096;

struct UpdatePipelineOptions {
  /// Bytes per staging slot and the most per direct chunk, >= 64 (default
  /// kDefaultChunkBytes). Direct updates under 4 chunks per thread (workers
  /// and the waiter) are cut finer, down to 64 KiB, so that every thread
  /// gets a share. Larger chunks cost fewer copy calls and hand-offs
  /// but a longer pipeline fill and more staging memory, and a chunk larger
  /// than the last-level cache is evicted before the worker reads it back,
  /// so its bytes cross the memory bus twice more (see kDefaultChunkBytes).
  int64_t chunkBytes = kDefaultChunkBytes;
  /// Staging slots, >= 1 (default kDefaultNumSlots). Staging memory is at
  /// most numSlots x chunkBytes, and only what the staged bytes need: none
  /// for sources in host memory, one slot of about the model's size for a
  /// device model smaller than a chunk (see the file comment).
  int numSlots = kDefaultNumSlots;
  /// Threads for the math; not owned, must outlive the pipeline and have
  /// at least one worker (the engine's thread must not run the math).
  /// nullptr (default): WorkerPool::shared().
  WorkerPool* pool = nullptr;
  /// Moves the bytes; not owned, must outlive the pipeline. Required.
  CopyEngine* engine = nullptr;
  /// Where the staging slots come from; not owned. nullptr (default): plain
  /// host memory (fine for the host engine; the CUDA engine wants pinned).
  PinnedArena* arena = nullptr;
  /// false (default): sources in host memory take the direct path (read in
  /// place by the workers; fence() waits for their math). true: they are
  /// staged through the engine like device sources, which costs 8 more
  /// bytes of memory traffic per fp32 element (4 per bf16) but lets fence()
  /// return before their math: for benchmarks and tests of the staged path
  /// without a GPU. Device sources are staged either way.
  bool stageHostSources = false;
};

/// One tensor of an update.
struct PipelineJob {
  /// Host storage updated in place: CPU, contiguous, same number of
  /// elements as source; float32 unless op is kCopyRaw.
  at::Tensor ema;
  /// Read by the engine; any device, contiguous. Kept alive by the pipeline
  /// until the update's math is done; should not be written before fence()
  /// (a write is reported, see the file comment).
  at::Tensor source;
  /// kLerp: ema += weight * (source - ema); kCopy: ema = float(source);
  /// kCopyRaw: ema has the source's dtype and receives its bytes unchanged
  /// (copied buffers such as integer counters). kSkip is refused.
  UpdateOp op = UpdateOp::kLerp;
  /// Named in errors.
  std::string name;
  /// Further float32 EMAs of the same source (post-hoc profiles: one per
  /// sigma_rel), same numel, host, contiguous. They are updated in the same
  /// pass as `ema`, each with its own weight (submit's weights[1], [2], ...),
  /// so the source is staged and read once whatever the number of profiles.
  /// Must be empty for raw copies.
  std::vector<at::Tensor> moreEmas;
  /// The version counter that in-place writes to this source bump, when it
  /// is not the source's own: a DTensor's local tensor keeps its counter
  /// while writes through the DTensor bump the DTensor's. A handle (it does
  /// not keep any tensor alive). Default: the source's.
  std::optional<c10::VariableVersion> version = std::nullopt;
};

/// A host tensor to write into a destination (swap-in, restore).
struct SwapJob {
  /// CPU, contiguous.
  at::Tensor host;
  /// Any device, same shape; converted to its dtype.
  at::Tensor destination;
  std::string name;
};

class UpdatePipeline {
 public:
  /// Checks the options; allocates no staging (see the file comment).
  /// c10::ValueError for bad options.
  explicit UpdatePipeline(UpdatePipelineOptions options);
  /// Waits for an update in flight (an error is dropped with a warning).
  ~UpdatePipeline();
  UpdatePipeline(const UpdatePipeline&) = delete;
  UpdatePipeline& operator=(const UpdatePipeline&) = delete;

  /// Starts an update of every job as step `step` and returns at once
  /// (after the first copies are queued). weights[0] is the lerp weight
  /// (1 - decay) of every job's ema, weights[p] that of its moreEmas[p - 1]:
  /// one profile is submit(jobs, {weight}, step). 1 to kMaxProfiles weights,
  /// each in [0, 1]; every non-raw job has weights.size() - 1 moreEmas.
  /// The previous update must have been waited for (wait(); c10::Error
  /// naming its step otherwise): the pipeline's owner waits once, and
  /// submit() never waits behind its back. Each job is validated once,
  /// here, before anything starts (c10::ValueError / TypeError naming the
  /// tensor); the copies and the math trust it. A job's EMA tensors are
  /// checked when first seen at their index and then held: while a job
  /// names the same EMA tensors as the one at its index last time, their
  /// checks and addresses are reused, and their metadata must not change
  /// (the pipeline is their one writer; resize or re-point one and submit
  /// it under another index, or a new tensor).
  void submit(std::vector<PipelineJob> jobs, std::vector<float> weights, int64_t step);
  /// The last submit()'s jobs, moved out, for a caller that submits the
  /// same jobs again with a few fields changed: an update of the same
  /// model then copies no tensor handle and no name (each a write to a
  /// cold cache line with a large model). The previous update must have
  /// been waited for (c10::Error otherwise); empty after a takeJobs() or
  /// before any submit(). writtenWhileRead(), writtenSinceSubmit() and
  /// uncheckedReads() still answer for that update.
  std::vector<PipelineJob> takeJobs();
  /// Blocks until every chunk of the update in flight has been read out of
  /// its source: a direct chunk once its math is done (the direct chunks no
  /// worker has started yet run on this thread meanwhile), a staged one once
  /// it is copied (with the CUDA engine: until every copy is queued, then
  /// the training stream waits on them). Late staged chunks' copies wait
  /// for early chunks' math (bounded staging), so this waits for all but
  /// the last numSlots staged chunks' math. Then releases the sources: they
  /// may change from now on, and the chunk checks stop. Records the time
  /// waited. Never throws for a worker error (wait() reports it).
  void fence();
  /// Blocks until the update in flight is done, running the direct chunks
  /// no worker has started yet on this thread; rethrows its first error
  /// (c10::Error naming the tensor, chunk and step) once. Releases the
  /// sources as fence() does.
  void wait();
  /// The jobs (indices into the last submit()'s list, ascending) whose
  /// source a chunk check saw written while the update could still read
  /// it (see the file comment). Complete once fence() or wait() returned;
  /// empty when nothing was submitted. Caller's thread.
  std::vector<size_t> writtenWhileRead() const;
  /// The jobs of the last submit() (indices, ascending) whose source's
  /// version counter has moved since submit(), read now. Caller's thread;
  /// the jobs' sources are the last submit()'s until the next one.
  std::vector<size_t> writtenSinceSubmit() const;
  /// The jobs of the last submit() (indices, ascending) whose reads no
  /// chunk check could time: staged through an engine whose copies do not
  /// run on the host's timeline (CUDA). A write to one of them before
  /// fence() may have reached the device during its copy.
  std::vector<size_t> uncheckedReads() const;
  /// Whether an update is submitted and not yet done.
  bool busy() const;
  /// Whether fence() or wait() has run since the last submit() (or nothing
  /// was submitted): the sources are then free to change.
  bool sourcesReleased() const;

  /// Writes every job's host tensor into its destination through the engine
  /// (chunked through the staging slots when the dtype differs). Waits for
  /// an update in flight first. Blocks until the copies are done.
  void copyTo(const std::vector<SwapJob>& jobs);

  /// Counters so far; any thread.
  PipelineStats stats() const;
  const UpdatePipelineOptions& options() const { return options_; }

 private:
  // A contiguous run of one job's elements (update_pipeline_plan.cpp).
  struct Piece {
    size_t job = 0;
    const char* src = nullptr;               // source bytes (any device)
    char* ema = nullptr;                     // first EMA element of the piece (host)
    int64_t count = 0;                       // elements
    int64_t bytes = 0;                       // source bytes
    int64_t stagingOffset = 0;               // where a staged piece lands in its slot
    SourceType type = SourceType::kFloat32;  // unused for raw copies
  };
  // One chunk: pieces_[begin, end).
  struct Chunk {
    size_t begin = 0;
    size_t end = 0;
  };
  struct SwapState;
  // What the pipeline checked of one job's EMA tensors (held, so that an
  // equal TensorImpl address is the same tensor) and what plan() reads of
  // them, so that an update of the same jobs reads no EMA TensorImpl or
  // storage on the submitting thread.
  struct CheckedEma {
    at::Tensor ema;
    std::vector<at::Tensor> more;
    char* data = nullptr;
    int64_t numel = 0;
    int64_t elementSize = 0;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
  };
  static bool sameEmas(const CheckedEma& checked, const PipelineJob& job);
  // The one validation of job `index` per update (its source, and its EMAs
  // when checkedEmas_ has not seen them at that index); its source type.
  SourceType checkJob(const PipelineJob& job, size_t index, size_t profiles);
  // Cuts the jobs (of the given source types) into chunks of at most
  // chunkBytes: the direct jobs' chunks first, then the staged ones'.
  // Reuses pieces_ and chunks_'s memory from update to update.
  void plan(const std::vector<PipelineJob>& jobs, const std::vector<SourceType>& types);
  // Whether job `job`'s source takes the direct path.
  bool readsInPlace(const PipelineJob& job, size_t index) const;
  void issueChunk(int64_t chunk, int slot);
  // Makes slot `slot` hold at least `bytes` (rounded up to
  // kStagingGranularity, at most chunkBytes), allocating or replacing it.
  // It allocates only on the submitting thread, while no copy uses the
  // slot (submit() issuing a slot's first chunk, copyTo()); a worker's
  // refill finds the slot large enough and returns.
  void reserveSlot(int slot, int64_t bytes);
  void onPieceLanded(int slot, std::exception_ptr error);
  int64_t chunkInSlot(int slot) const;
  // How many parts (one worker task each) a landed staged chunk's math takes.
  int partsOf(int64_t chunk) const;
  void runChunkPart(int slot, int64_t chunk, int part, int parts);
  // Worker (onWaiter: the thread in fence()/wait()): direct chunk `chunk`,
  // then the next unclaimed ones in order.
  void runDirectChunks(int64_t chunk, bool onWaiter);
  // fence()/wait(): runs the direct chunks no worker has claimed yet.
  void helpWithDirectChunks();
  // The math of part `part` of `parts` of one chunk, on this thread;
  // staging == nullptr for a direct chunk (its pieces read their sources in
  // place).
  void applyChunk(int64_t chunk, const char* staging, int part, int parts);
  void finishChunk(int slot, std::exception_ptr&& error);
  // The failure of chunk `chunk`, naming its tensors and the step.
  std::exception_ptr chunkError(int64_t chunk, const std::string& failure) const;
  // Marks the chunk's jobs whose source moved since submit() (check (1)),
  // unless the sources are released. Caller holds mutex_.
  void markWrittenSources(int64_t chunk);
  // Whether every chunk of the update in flight is done. Caller holds mutex_.
  bool allDone() const;
  void queueSwapCopies(const std::vector<SwapJob>& jobs, SwapState& state);
  // The error a failed update reports from wait(), naming its step.
  std::exception_ptr updateError(const std::string& what) const;
  // Records each source's version counter, reusing the handle of a source
  // that is the one of the last update at that index (versionSources_).
  void recordVersions();
  // Whether job `job`'s source moved since submit(). Any thread.
  bool movedSince(size_t job) const;
  // fence()/wait(): the sources may change from now on. Caller holds mutex_.
  void releaseSources() { released_ = true; }

  UpdatePipelineOptions options_;
  WorkerPool* pool_ = nullptr;
  // numSlots entries from the constructor on (so that a slot's entries
  // never move); a slot is undefined / nullptr / 0 until reserveSlot().
  std::vector<at::Tensor> staging_;
  std::vector<char*> stagingData_;
  std::vector<int64_t> slotBytes_;

  // The update in flight. Written by submit() before any copy is queued and
  // read-only afterwards (the engine and pool hand-offs order it).
  std::vector<PipelineJob> jobs_;
  std::vector<Piece> pieces_;
  std::vector<Chunk> chunks_;   // direct chunks first, then staged ones
  std::vector<char> inPlace_;   // per job: takes the direct path (plan())
  std::vector<SourceType> types_;  // per job: its checked source type
  int64_t directChunks_ = 0;    // chunks_[0, directChunks_) are direct
  int64_t stagedSlotBytes_ = 0;  // the largest staged chunk's extent in its slot
  std::vector<float> weights_;  // one per profile
  int64_t step_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // All guarded by mutex_.
  std::vector<int64_t> slotChunk_;          // chunk held by each slot, -1 if free
  std::vector<std::string> slotCopyError_;  // engine error per slot, "" if none
  std::vector<std::string> slotPartError_;  // first failed part's error per slot
  int64_t claimed_ = 0;                     // staged chunks given a slot (chunk directChunks_ + k)
  int64_t queued_ = 0;                      // staged chunks whose copies the engine has
  int64_t finished_ = 0;                    // staged chunks whose math is done or skipped
  int64_t directClaimed_ = 0;               // direct chunks a worker has taken
  int64_t directDone_ = 0;                  // direct chunks whose math is done or skipped
  bool inFlight_ = false;
  bool failed_ = false;
  std::exception_ptr firstError_;
  PipelineStats stats_;
  // Autograd version counter of each job's source and its value at submit
  // (disabled for inference tensors: never checked). Written by submit()
  // before any copy is queued, read-only afterwards.
  std::vector<std::pair<c10::VariableVersion, uint32_t>> versions_;
  // Per job index: the source whose counter versions_ holds (kept alive, so
  // an equal TensorImpl address is the same tensor), and the EMAs checked.
  std::vector<at::Tensor> versionSources_;
  std::vector<CheckedEma> checkedEmas_;
  bool checkOnLanding_ = false;  // the landing check; fixed by the engine's kind
  // Per job of the update in flight: a chunk check saw its source written
  // (1) or not (0). Guarded by mutex_.
  std::vector<char> writtenWhileRead_;
  bool released_ = true;         // guarded by mutex_: sources checked and free
  // Copies of the slot's chunk not yet landed; counted down by the engine.
  std::unique_ptr<std::atomic<int>[]> piecesLeft_;
  // Math parts of the slot's landed chunk not yet done; counted down by the
  // workers, the last one finishes the chunk.
  std::unique_ptr<std::atomic<int>[]> partsLeft_;
};

}  // namespace offload
}  // namespace shardema
