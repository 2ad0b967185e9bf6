#pragma once
// Every Averager alive in this process, known to one place, so that one call
// makes every background read safe before the sources change: the
// optimizer's step (the Python front calls fenceEveryAverager() from a
// global optimizer step pre-hook, so the loop ema-pytorch users write,
// optimizer.step() then update() with no fence(), is exact) and a write of
// EMA weights into a model that another Averager may be reading (a swap).
#include <cstddef>

namespace shardema {

/// Calls fence() on every Averager alive in this process that is not
/// failed (a failed one keeps its error for its owner's next call): returns
/// once each has read the sources of its update in flight. For the thread
/// that trains: an Averager is used by one thread at a time (averager.h),
/// and this calls into each. Blocks; never throws (an unexpected error is
/// warned about).
void fenceEveryAverager();

/// How many Averagers are alive in this process (moved-from ones
/// included until they are destroyed). Does not block on them.
size_t liveAveragers();

}  // namespace shardema
