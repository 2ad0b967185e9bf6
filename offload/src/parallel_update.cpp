#include "shardema/offload/parallel_update.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "shardema/offload/worker_pool.h"

namespace shardema::offload {
namespace {

// A few pieces per thread so a thread slowed by a neighbour process hands
// work to the others; more would only add scheduling overhead.
constexpr int64_t kPiecesPerThread = 4;

template <typename Span, typename Run>
void spread(WorkerPool& pool, const std::vector<Span>& spans, int64_t minGrain, const Run& run) {
  TORCH_CHECK_VALUE(minGrain >= 1, "shardema::offload::updateOnPool: minGrain must be >= 1, got ",
                    minGrain);
  const int64_t total = totalElements(spans);
  const int64_t pieces = piecesFor(total, pool.size() + 1, minGrain);
  if (pieces <= 1) {
    run(0, kAllElements);  // also checks the spans when there is nothing to do
    return;
  }
  pool.parallelFor(pieces, [&](int64_t p) {
    run(pieceBegin(p, pieces, total), pieceBegin(p + 1, pieces, total));
  });
}

}  // namespace

int64_t piecesFor(int64_t total, int64_t threads, int64_t minGrain) {
  if (threads <= 1 || total <= 0) return 1;
  return std::clamp<int64_t>(total / std::max<int64_t>(minGrain, 1), 1,
                             threads * kPiecesPerThread);
}

int64_t pieceBegin(int64_t p, int64_t pieces, int64_t total) {
  return (total / pieces) * p + std::min(p, total % pieces);
}

void updateOnPool(WorkerPool& pool, const std::vector<UpdateSpan>& spans, float weight,
                  int64_t minGrain) {
  spread(pool, spans, minGrain,
         [&](int64_t begin, int64_t end) { updateSpans(spans, weight, begin, end); });
}

void updateOnPool(WorkerPool& pool, const std::vector<MultiUpdateSpan>& spans,
                  const std::vector<float>& weights, int64_t minGrain) {
  spread(pool, spans, minGrain,
         [&](int64_t begin, int64_t end) { updateSpansMulti(spans, weights, begin, end); });
}

}  // namespace shardema::offload
