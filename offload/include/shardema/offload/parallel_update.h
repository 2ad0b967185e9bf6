#pragma once
// updateOnPool: one update of many spans spread over a WorkerPool's workers
// and the calling thread. Offload owns the threads, so offload cuts the
// work: core's kernels (update_kernels.h) run one range of the spans on
// whichever thread is handed it and never reach for threads themselves.
// For callers on their own thread (benchmarks, tools, tests); the update
// pipeline's workers run one chunk each and call the kernels directly, so a
// kernel never spreads work from inside a worker.
#include <cstdint>
#include <vector>

#include "shardema/core/update_kernels.h"

namespace shardema::offload {

class WorkerPool;

/// Smallest piece, in (source) elements, worth a thread's hand-off.
constexpr int64_t kDefaultMinGrain = int64_t{1} << 15;

/// updateSpans(spans, weight) cut into pieces of at least `minGrain`
/// elements (a few per thread, so a thread slowed by a neighbour hands work
/// to the others) run on `pool`'s workers and the caller; one huge tensor
/// and a thousand small ones both use every thread. Blocks until done; the
/// result does not depend on the split. c10::ValueError for minGrain < 1
/// and whatever updateSpans refuses.
void updateOnPool(WorkerPool& pool, const std::vector<UpdateSpan>& spans, float weight,
                  int64_t minGrain = kDefaultMinGrain);
/// The same for several profiles (updateSpansMulti).
void updateOnPool(WorkerPool& pool, const std::vector<MultiUpdateSpan>& spans,
                  const std::vector<float>& weights, int64_t minGrain = kDefaultMinGrain);

/// Pieces for `total` elements over `threads` threads (workers and the
/// caller): at most kPiecesPerThread per thread, none under minGrain.
int64_t piecesFor(int64_t total, int64_t threads, int64_t minGrain);
/// First element of piece p of `pieces` over `total` (sizes differ by at
/// most one element).
int64_t pieceBegin(int64_t p, int64_t pieces, int64_t total);

}  // namespace shardema::offload
