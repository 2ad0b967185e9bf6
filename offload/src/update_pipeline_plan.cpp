// UpdatePipeline::plan: how an update is cut into chunks. Runs on the
// submitting thread before any chunk is handed out; workers and copy
// callbacks then read pieces_ and chunks_ without locks.
#include <algorithm>

#include "shardema/core/failpoint.h"
#include "shardema/offload/update_pipeline.h"
#include "shardema/offload/worker_pool.h"

namespace shardema::offload {
namespace {

// Piece starts in a slot are cache-line aligned: two pieces never share a
// line, and the kernels' vector loads start aligned. Direct chunks are cut
// by the same rule, so a job is cut alike whichever path it takes.
constexpr int64_t kPieceAlign = 64;

int64_t alignUp(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// Direct chunks are taken by the workers and by the thread waiting in
// fence()/wait() (helpWithDirectChunks). Cut into chunkBytes, an update
// smaller than one chunk would run on one thread, after a worker's wake-up
// (tens of microseconds on a VM, as long as the math of a few MiB); a few
// chunks per thread let whoever is free share it. Below kMinDirectChunkBytes
// a chunk's checks and hand-off would cost more than the sharing saves.
constexpr int64_t kDirectChunksPerThread = 4;
constexpr int64_t kMinDirectChunkBytes = int64_t{64} << 10;

}  // namespace

bool UpdatePipeline::readsInPlace(const PipelineJob& job, size_t index) const {
  if (options_.stageHostSources || !job.source.device().is_cpu()) return false;
  return !failpoint::fires("offload.pipeline.stage_host_source", static_cast<int64_t>(index));
}

void UpdatePipeline::plan(const std::vector<PipelineJob>& jobs,
                          const std::vector<SourceType>& types) {
  // clear() keeps the capacity: an update of the same model allocates
  // nothing here.
  pieces_.clear();
  chunks_.clear();
  // Each job's path is decided once (a failpoint may choose it).
  inPlace_.assign(jobs.size(), 0);
  int64_t directBytes = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    inPlace_[j] = readsInPlace(jobs[j], j);
    if (inPlace_[j]) directBytes += static_cast<int64_t>(jobs[j].source.nbytes());
  }
  const int64_t threads = pool_->size() + 1;
  int64_t capacity =
      std::min(options_.chunkBytes,
               std::max(kMinDirectChunkBytes,
                        alignUp(directBytes / (kDirectChunksPerThread * threads), kPieceAlign)));
  int64_t used = capacity;  // the first piece opens a chunk
  const auto cut = [&](size_t j) {
    const int64_t srcSize = jobs[j].source.element_size();
    // The EMA's, as checkJob() recorded them: no read of its TensorImpl.
    const int64_t emaSize = checkedEmas_[j].elementSize;
    const auto* src = static_cast<const char*>(jobs[j].source.data_ptr());
    char* ema = checkedEmas_[j].data;
    const int64_t total = jobs[j].source.numel();
    for (int64_t first = 0; first < total;) {
      int64_t offset = alignUp(used, kPieceAlign);
      if (offset + srcSize > capacity) {
        chunks_.push_back(Chunk{pieces_.size(), pieces_.size()});
        offset = 0;
      }
      const int64_t count = std::min(total - first, (capacity - offset) / srcSize);
      pieces_.push_back(Piece{j, src + first * srcSize, ema + first * emaSize, count,
                              count * srcSize, offset, types[j]});
      chunks_.back().end = pieces_.size();
      used = offset + count * srcSize;
      first += count;
    }
  };
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (inPlace_[j]) cut(j);
  }
  directChunks_ = static_cast<int64_t>(chunks_.size());
  capacity = options_.chunkBytes;  // a staged chunk fills a slot
  used = capacity;                 // staged chunks never share one with direct pieces
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!inPlace_[j]) cut(j);
  }
  // What a slot must hold for this update: the largest staged chunk's end
  // in its slot (its pieces are in offset order).
  stagedSlotBytes_ = 0;
  for (size_t k = static_cast<size_t>(directChunks_); k < chunks_.size(); ++k) {
    const Piece& last = pieces_[chunks_[k].end - 1];
    stagedSlotBytes_ = std::max(stagedSlotBytes_, last.stagingOffset + last.bytes);
  }
}

}  // namespace shardema::offload
